"""Processes the suite starts, forked from one that has imported onlinespec already.

A fresh interpreter pays about 9 s on a core of the suite's machine before it does anything:
``import onlinespec.cli`` is torch and transformers' modeling stack. The suite starts about 25
servers and 30 fault-suite children, so each worker keeps one fork server (multiprocessing's,
started on first use) that imported them once, and forks each child from it. The child is
still a process of its own: its own pid, killed for real, its exit status read back. Only the
import is shared; nothing has run in the fork server (no torch thread, no model).

``python -m onlinespec.cli ARGS`` and :func:`run_cli` run the same code: the CLI's ``app`` on
the same arguments, environment and thread count.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
# What a child imports anyway, imported once in the fork server. ``forked`` and the fault suite's
# ``child`` are found through PYTHONPATH (Python 3.11's fork server does not take the caller's
# sys.path).
PRELOAD = ["forked", "child", "onlinespec.cli", "onlinespec.serve.app", "onlinespec.serve.core", "onlinespec.models",
           "transformers.models.llama.modeling_llama", "transformers.generation.utils", "uvicorn"]


def context() -> multiprocessing.context.ForkServerContext:
    """This process's fork server (started on the first call, then shared)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE / "faults"), *([before] if before else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def run_cli(argv: list[str], log: str | None, env: dict[str, str]) -> None:
    """``onlinespec ARGV`` in this (forked) process: its output appended to ``log`` (or dropped),
    the environment replaced by ``env`` as a fresh interpreter would have it."""
    target = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for fd in (1, 2):
        os.dup2(target, fd)
    os.close(target)
    os.environ.clear()
    os.environ.update(env)
    import torch

    from onlinespec.cli import app
    from onlinespec.storage import KILL_ENV, arm_kill_points

    # what the variables give a fresh interpreter, whose OpenMP and kill points read them at import
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    arm_kill_points(env.get(KILL_ENV, ""))
    sys.argv = ["onlinespec", *argv]
    app(args=argv, prog_name="onlinespec")


class Forked:
    """A forked child behind the part of :class:`subprocess.Popen`'s face that
    :class:`onlinespec.serve.server.ServerProcess` and the tests use."""

    def __init__(self, process: multiprocessing.Process) -> None:
        self._process, self.pid = process, process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"onlinespec (pid {self.pid})", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def launch(argv: list[str], log: Path | None, env: dict[str, str] | None) -> Forked:
    """:attr:`ServerProcess.launch <onlinespec.serve.server.ServerProcess.launch>` for the suite."""
    process = context().Process(target=run_cli, args=(list(argv), str(log) if log else None, dict(env or os.environ)), daemon=True)
    process.start()
    return Forked(process)


def run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``onlinespec ARGV`` in a forked child, to its end: :func:`subprocess.run`'s answer, stdout
    and stderr together in ``stdout`` (a child killed past ``timeout`` raises TimeoutExpired)."""
    with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
        child = launch(argv, Path(log.name), env)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        return subprocess.CompletedProcess(["onlinespec", *argv], code, log.read(), "")


def publish_forever(folder: str, ready) -> None:
    """The registry's kill test: publish version after version into ``folder`` until killed
    (``ready`` is set once the first is published)."""
    import torch

    from onlinespec.online.registry import DraftRegistry

    registry = DraftRegistry(folder)
    i = 0
    while True:
        i += 1
        registry.publish({"w": torch.full((512, 1024), float(i))}, {"parent": registry.current()})
        if i == 1:
            ready.set()
