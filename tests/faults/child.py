"""A serving process for the fault suite (not a test): a learning core on the tiny target that
serves ``n`` requests one after another and prints one JSON line per answer, once the client
has it (its training record is durable by then: an acknowledged record). Each update runs to
its end before the next request, so the n-th publish comes at a known point of the run. ``ONLINESPEC_KILL_AT``
kills it at a named point, its hits counted from the first acknowledged request on (so every case
has at least one acknowledged record to lose); ``FAULT_FSIZE`` caps the size of any file it writes from the first
request on (``RLIMIT_FSIZE``: a disk that fills up while serving).

The suite starts it with :func:`forked`: from a fork server that has imported this module once
(``tests/faults/conftest.py``), so each case pays no interpreter start-up or torch import, and
the child is still a process of its own that the kill points SIGKILL. ``python child.py OUT
TARGET N`` runs it the same way by hand."""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

KILL_AT = os.environ.pop("ONLINESPEC_KILL_AT", "")  # before onlinespec reads it: armed after the first answer

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.online.learner import LearnerConfig
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore
from onlinespec.storage import arm_kill_points


def config(target: str, retention_days: float | None = None) -> CoreConfig:
    """The fault suite's core: learns every 2 requests, publishes every candidate (gate margin 1)."""
    learner = LearnerConfig(update_interval=2, steps_per_update=2, batch_size=4, priority="normal", gate_margin=1.0, max_failures=2)
    return CoreConfig(target=target, draft="target-layers:1", k=2, kernels=False, adaptive_k=False, max_batch=2,
                      learner=learner, retention_days=retention_days)


def prompt(i: int) -> str:
    return f"def step_{i}(x):\n    return"


def main() -> None:
    out, target, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    core = ServingCore(config(target), out)
    core.load()
    core.submit("# warm-up", SamplingParams(temperature=0.0, max_new_tokens=2), domain="code", train=False).result()  # makes the draft (v0001)
    if os.environ.get("FAULT_FSIZE"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        limit = int(os.environ["FAULT_FSIZE"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    print("READY", flush=True)
    for i in range(n):
        served = core.submit(prompt(i), SamplingParams(temperature=0.0, max_new_tokens=6), domain="code", request_id=f"r{i}").result()
        print(json.dumps({"id": served.request_id, "recorded": served.recorded, "version": served.draft_version}), flush=True)
        core.pool.wait()  # the update this request made due runs now: one publish every 2 requests, on any machine
        if i == 0:
            arm_kill_points(KILL_AT)
    core.pool.wait(drain=True)
    print("DONE " + json.dumps({"governance": core.governance(), "drafts": core.drafts()}), flush=True)
    core.shutdown(5)


def forked(out: str, target: str, n: int, stdout: str, stderr: str, kill_at: str = "", fsize: int | None = None) -> None:
    """:func:`main` in a process forked from one that imported this module (the fault suite's fork
    server): its output goes to the files ``stdout`` and ``stderr``, and ``kill_at`` and ``fsize`` take
    the place of ``ONLINESPEC_KILL_AT`` and ``FAULT_FSIZE``."""
    global KILL_AT
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    KILL_AT = kill_at
    os.environ.pop("ONLINESPEC_KILL_AT", None)
    os.environ.pop("FAULT_FSIZE", None)
    if fsize:
        os.environ["FAULT_FSIZE"] = str(fsize)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 gives a fresh interpreter (its OpenMP read the variable at import)
    sys.argv = [__file__, out, target, str(n)]
    main()


if __name__ == "__main__":
    main()
