"""The fault suite: real processes killed with SIGKILL at named points of serving, recording and
publishing, a disk that fills up, corrupt and stray files, two processes on one out-dir, clock
jumps. After each fault a process restarted on the same out-dir must serve the last published
version, hold every acknowledged record exactly once, and load nothing corrupt.
Run it alone with ``pytest -m faults``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.registry import DraftRegistry
from onlinespec.serve.core import ServingCore
from onlinespec.weights import unique_tensors

sys.path.insert(0, str(Path(__file__).parent))
import forked  # noqa: E402  (tests/, on sys.path through the root conftest)
from child import config  # noqa: E402
from child import forked as child_main  # noqa: E402

CHILD = Path(__file__).parent / "child.py"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.faults)


class Run:
    """A finished (or killed) child: its exit status, its acknowledged answers, its last line."""

    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.returncode, self.stderr = proc.returncode, proc.stderr
        lines = proc.stdout.splitlines()
        self.answers = [json.loads(line) for line in lines if line.startswith("{")]
        self.done = next((json.loads(line[5:]) for line in lines if line.startswith("DONE ")), None)

    @property
    def acknowledged(self) -> list[str]:
        """Requests whose client got an answer saying its record is stored."""
        return [a["id"] for a in self.answers if a["recorded"]]


@pytest.fixture(scope="session")
def fork_server():
    """Children are forked from the worker's fork server (``tests/forked.py``), which imported
    ``child`` (and with it torch, transformers' Llama and onlinespec) once: a case pays no
    interpreter start-up and imports (about 3 s of its 5 on a CPU of the suite's), and its child
    is still a separate process, killed for real."""
    return forked.context()


@pytest.fixture
def run_child(tiny_target_folder, fork_server, tmp_path_factory):
    def run(out: Path, n: int = 8, kill_at: str | None = None, fsize: int | None = None, timeout: float = 180) -> Run:
        logs = tmp_path_factory.mktemp("child")
        stdout, stderr = logs / "stdout", logs / "stderr"
        child = fork_server.Process(target=child_main, args=(str(out), str(tiny_target_folder), n, str(stdout), str(stderr), kill_at or "", fsize))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(f"{CHILD} {out}", timeout, stdout.read_text(), stderr.read_text())
        return Run(subprocess.CompletedProcess([str(CHILD)], child.exitcode, stdout.read_text(), stderr.read_text()))

    return run


@pytest.fixture
def restart(tiny_target_folder):
    """Restart a core on ``out`` and check what the suite promises; return what it found."""

    def check(out: Path, acknowledged: list[str], **overrides) -> dict:
        registry = DraftRegistry(out / "drafts" / "code")
        core = ServingCore(config(str(tiny_target_folder), **overrides), out)
        core.load()
        try:
            served = core.submit("def again(x):", SamplingParams(temperature=0.0, max_new_tokens=4), domain="code",
                                 request_id="after").result()
            draft = core.pool.drafts["code"]
            current = registry.current()
            assert current in registry.versions() and served.draft_version == current
            serving = unique_tensors(draft.proposer.model.state_dict())
            published = registry.load(current)
            assert serving.keys() == published.keys() and all(torch.equal(serving[k], published[k]) for k in published)
            held = [r.request_id for r in draft.learner.buffer.records()]
            governance = core.governance()
        finally:
            core.shutdown(5)
        assert len(held) == len(set(held)), f"a record is held twice: {sorted(held)}"
        missing = [rid for rid in acknowledged if rid not in held]
        assert not missing, f"acknowledged records lost: {missing}"
        again = [r.request_id for r in ReplayBuffer(out / "buffer" / "code").records()]
        assert again.count("after") == 1 and all(again.count(rid) == 1 for rid in acknowledged)
        return {"current": current, "held": held, "governance": governance, "served": served}

    return check
