"""Who gets the CPU: the priority of our threads beside serving.

On a machine that serving saturates, the engine's OpenMP team is the work that matters: every
thread that wakes beside it takes a core from one of its threads, and the others wait for that
one at the next barrier. Linux schedules threads (tasks), each with its own nice value, so the
priority of one thread can be lowered without touching the others.

- :func:`lower_priority`: the calling thread, for background work (the learner, the content
  router's scorer).
- :func:`name_thread`: the calling thread's name as the OS shows it (``ps -L``, ``top -H``);
  threads it starts later, such as its OpenMP team, inherit the name.
- :func:`lower_other_threads`: every thread of this process but the engine's, for a process whose
  other threads only carry messages (a Ray replica's and the front's plumbing; docs/scale.md);
  :func:`keep_other_threads_lowered` again every few seconds, for threads that libraries start
  later from an engine thread and then rename.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

ENGINE_THREAD = "onlinespec-eng"  # the OS name of the engine thread and of the OpenMP threads it starts (15 characters at most)
PLUMBING_NICE = 10  # lower_other_threads' default: a 10th of a nice-0 thread's CPU weight when they compete

log = logging.getLogger(__name__)


def lower_priority(priority: str = "low") -> None:
    """Lower the calling thread's CPU priority, for background work beside serving (the learner,
    the content router's scorer). On Linux a thread is a task, so only this thread changes.

    ``low``: nice 19, the smallest CPU weight; ``idle``: the SCHED_IDLE policy, whose thread any
    normal thread that wakes preempts at once (a nice-19 thread may keep a core for the rest of its
    time slice, while an engine's OpenMP team waits at a barrier for it); ``normal``: unchanged.
    Where the OS refuses, the thread keeps its priority."""
    try:
        if priority == "idle" and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif priority in ("low", "idle") and hasattr(os, "setpriority"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass


def name_thread(name: str) -> None:
    """Name the calling thread for the OS (Linux keeps 15 characters); elsewhere, nothing."""
    try:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name[:15])
    except OSError:
        pass


def lower_other_threads(nice: int = PLUMBING_NICE, keep: str = ENGINE_THREAD) -> int:
    """Every thread of this process whose OS name does not start with ``keep`` to at least
    ``nice``; threads they start later inherit it. Raises no thread's priority. Returns how many
    it lowered (0 where the OS has no per-thread nice)."""
    lowered = 0
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return 0
    for task in tasks:
        try:
            if (task / "comm").read_text().strip().startswith(keep):
                continue
            tid = int(task.name)
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                lowered += 1
        except (OSError, ValueError):  # it ended meanwhile
            continue
    log.debug("lowered %d threads to nice %d", lowered, nice)
    return lowered


def keep_other_threads_lowered(nice: int = PLUMBING_NICE, keep: str = ENGINE_THREAD, every: float = 5.0) -> threading.Thread:
    """:func:`lower_other_threads` now, then every ``every`` seconds on a daemon thread, for the
    life of the process (a library may start a thread from an engine thread, which inherits its
    priority, and then rename it)."""
    lower_other_threads(nice, keep)

    def again() -> None:
        while True:
            time.sleep(every)
            lower_other_threads(nice, keep)

    thread = threading.Thread(target=again, name="onlinespec-nice", daemon=True)
    thread.start()
    return thread
