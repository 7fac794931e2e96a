"""Run the server (uvicorn), and start one as a child process (the demo, tests, benchmarks).

SIGTERM (or Ctrl-C) is a graceful stop: uvicorn stops accepting connections and lets the
requests in flight finish for ``drain_seconds``; then the core fails what is left, writes every
finished request's records, abandons an update in flight without publishing, and the process
exits 0. A restart on the same ``--out-dir`` serves each draft's last published version.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn

from onlinespec.serve.app import create_app
from onlinespec.serve.interface import Core
from onlinespec.serve.logs import LogSettings, configure_logging
from onlinespec.serve.web import ServerSettings


def serve(make_core: Callable[[], Core], host: str = "127.0.0.1", port: int = 8000,
          settings: ServerSettings | None = None, logs: LogSettings | None = None) -> None:
    """Serve until SIGTERM / SIGINT (blocking). Log lines go to stderr (:mod:`onlinespec.serve.logs`:
    one JSON object each by default; a request line per request, an access line per HTTP request).
    ``make_core`` builds what serves the requests: a :class:`ServingCore` in this process, or
    replicas on Ray (``onlinespec.scale.RayCore``; the CLI chooses, so serving never imports scale)."""
    settings = settings or ServerSettings()
    uvicorn_level = configure_logging(logs)
    app = create_app(make_core(), settings)
    # issue 46: connections bounded (503 past max_connections), idle keep-alive closed; bodies have a deadline (web.read_body)
    _Server(uvicorn.Config(app, host=host, port=port, log_level=uvicorn_level, access_log=False, log_config=None,
                           timeout_graceful_shutdown=int(settings.drain_seconds) or None, limit_concurrency=settings.max_connections,
                           timeout_keep_alive=max(1, round(settings.keep_alive_timeout)))).run()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """Like uvicorn's, except that a graceful stop ends the process with status 0 (uvicorn
        raises the signal again once it has stopped, so the process dies of it)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def fresh_interpreter(argv: list[str], log: str | Path | None, env: dict | None) -> subprocess.Popen:
    """``python -m onlinespec.cli ARGV`` in a new process, stdout and stderr appended to ``log``."""
    with open(log, "ab") if log else open(os.devnull, "wb") as output:
        return subprocess.Popen([sys.executable, "-m", "onlinespec.cli", *argv], stdout=output, stderr=subprocess.STDOUT,
                                env=env or os.environ.copy())


class ServerProcess:
    """``onlinespec serve ARGS`` in a child process on 127.0.0.1, ready when entered::

        with ServerProcess(["--out-dir", "runs/x"]) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

    Leaving sends SIGTERM and waits for a graceful exit.
    """

    def __init__(self, args: list[str], port: int | None = None, log: str | Path | None = None,
                 env: dict | None = None, ready_timeout: float = 900.0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args, self.log, self.env, self.ready_timeout = args, log, env, ready_timeout
        self.process: subprocess.Popen | None = None

    #: How the child starts: ``launch(argv, log, env)`` runs ``onlinespec ARGV`` with its output
    #: appended to ``log`` and returns a :class:`subprocess.Popen` (or anything with its ``pid``,
    #: ``returncode``, ``poll``, ``wait``, ``send_signal`` and ``kill``). A fresh interpreter by
    #: default; the test suite forks its servers from a process that imported onlinespec once.
    launch = staticmethod(fresh_interpreter)

    def start(self) -> ServerProcess:
        self.process = self.launch(["serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args], self.log, self.env)
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode} before it was ready"
                                   + (f" (log: {self.log})" if self.log else ""))
            try:
                response = httpx.get(self.url + "/ready", timeout=2)
                if response.status_code == 200:
                    return
                if response.status_code == 503 and response.json().get("status") == "failed":
                    raise RuntimeError(f"the server failed to load: {response.json().get('error')}")
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server was not ready within {self.ready_timeout:.0f} s")

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM, then wait for the exit code (SIGKILL after ``timeout``)."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
