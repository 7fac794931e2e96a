"""Thread priorities beside serving (onlinespec.cpu): the plumbing of a process yields, the engine
thread and the OpenMP threads it starts keep theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread names and priorities are Linux's")

CHILD = r"""
import json, os, threading
import torch
from onlinespec.cpu import ENGINE_THREAD, lower_other_threads, name_thread

ready, done = threading.Event(), threading.Event()
seen = {}

def engine():
    name_thread(ENGINE_THREAD)
    torch.set_num_threads(2)
    torch.ones(512, 512) @ torch.ones(512, 512)  # starts its OpenMP team, which inherits the name
    ready.set()
    done.wait()

def plumbing():
    done.wait()

threads = [threading.Thread(target=engine), threading.Thread(target=plumbing)]
for t in threads:
    t.start()
ready.wait()
lowered = lower_other_threads(10)
later = threading.Thread(target=lambda: seen.update(later=os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
later.start(); later.join()  # started by a lowered thread: inherits its priority
tasks = {}
for task in os.scandir("/proc/self/task"):
    comm = open(f"{task.path}/comm").read().strip()
    tasks.setdefault(comm, []).append(os.getpriority(os.PRIO_PROCESS, int(task.name)))
done.set()
print(json.dumps({"lowered": lowered, "tasks": tasks, **seen}))
"""


def test_lower_other_threads_spares_the_engine_and_its_openmp_team():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base >= 10:
        pytest.skip("this process already runs at nice 10 or more")
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    tasks = result["tasks"]
    engine = tasks.pop("onlinespec-eng")
    assert engine == [base] * len(engine) and len(engine) >= 2, tasks  # the engine thread and its OpenMP worker
    assert all(nice == 10 for nices in tasks.values() for nice in nices), tasks  # the main thread, the plumbing
    assert result["lowered"] >= 2
    assert result["later"] == 10
