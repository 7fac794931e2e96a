"""The CPU an update of the online learner may take (:mod:`onlinespec.online.learner`).

The learner thread runs ``threads`` torch threads. At ``priority="low"`` (the default) the OS runs
it at the lowest priority (nice 19, for that thread only), so it takes only the CPU time serving
leaves: on a 2-core machine that serving saturates, an update takes longer but requests keep their
speed (docs/learner-overhead.md and docs/online-experiments.md measure both). ``cpu_share`` caps
the share of wall time the learner computes (it sleeps between steps), for machines where it runs
at normal priority. With the serving engine's turns (:mod:`onlinespec.online.turns`), the update
computes only in the turns the engine gives it, never beside a step, and still on ``threads``
torch threads (default 1), not on every core: torch and llama.cpp share one OpenMP runtime
(``libgomp``), and a second thread team in the process (the learner's, even idle between its
turns) slows llama.cpp's (likely libgomp's rule for more OpenMP threads than cores: waits spin
100 times instead of 300,000 before sleeping, and llama.cpp's CPU graph crosses a barrier at
every node). On this project's 2-core machine a 1-token decode of the default target took 15-18 ms
against 9-10 ms while a learner with 2 torch threads took turns beside it (never at the same
time), 9.5 ms with 1; served at one request in flight, time per output token doubled while an
update ran with 2 threads and did not move with 1, and the update took no longer
(docs/online-learning.md, "Learning on the engine's time").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

import torch

from onlinespec.cpu import lower_priority, name_thread
from onlinespec.online.config import LearnerConfig
from onlinespec.online.turns import EngineTurns

_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


def return_freed_memory() -> None:
    """Hand the heap an update freed back to the OS (glibc's ``malloc_trim``; elsewhere nothing).
    An update's tensors grow with the replay buffer and are freed when it ends, but glibc keeps
    freed pages in the learner thread's arena: without this the server's resident memory keeps
    every update's high-water mark (docs/reliability.md, the soak)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


class UpdateBudget:
    """Enter an update's CPU budget, pause between its units of work, and leave it."""

    def __init__(self, config: LearnerConfig, background: bool, turns: EngineTurns | None, cancelled: Callable[[], bool]) -> None:
        self.config, self.background, self.turns, self.cancelled = config, background, turns, cancelled
        self.waited = 0.0  # seconds the update in flight waited for the engine's turns

    def enter(self) -> None:
        """Take the learner thread's budget: its torch threads and its priority; in the engine's
        turns no lower priority (serving waits meanwhile), and the same threads (see above)."""
        self.waited = 0.0
        if self.background:
            name_thread("onlinespec-learn")
        torch.set_num_threads(self.config.threads)
        if self.turns is not None:  # the same threads in its turns: a second OpenMP team slows llama.cpp (above)
            self.turns.take(self.cancelled)
            return
        if self.background:
            lower_priority(self.config.priority)

    def pause(self) -> None:
        """Between two units of work (an optimizer step, an evaluation): the engine's turn, if it ran out."""
        if self.turns is not None:
            self.waited += self.turns.checkpoint(self.cancelled)

    def step_done(self, since: float) -> float:
        """After an optimizer step begun at ``since`` (perf_counter): pause, and sleep so that
        computing takes at most ``cpu_share`` of wall time (outside the engine's turns). Returns
        when the next step begins."""
        self.pause()
        share = self.config.cpu_share
        if share < 1.0 and self.turns is None:
            time.sleep((time.perf_counter() - since) * (1.0 - share) / share)
        return time.perf_counter()

    def give_turn_back(self) -> None:
        """The update ended: the engine's turns are its own again."""
        if self.turns is not None:
            self.turns.done()

    def leave(self, had: int) -> None:
        """After an update: an update that ran on the serving thread gives it its ``had`` torch
        threads back; the heap it freed goes back to the OS."""
        if not self.background:
            torch.set_num_threads(had)
        return_freed_memory()
