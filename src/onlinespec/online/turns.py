"""Learning on the engine's time: the learner computes only in turns the serving engine gives it.

On a CPU serving and learning share the same few cores. Left to the OS, a learner thread either
starves (nice 19) or slows every request it runs beside (normal priority cost about 12% of
serving here, docs/learner-overhead.md). Here the engine owns the cores: the learner's thread
waits for a turn, the engine hands it one and waits while it runs (one optimizer step or one gate
evaluation at a time, a turn lasting about ``slice_seconds``), then takes the cores back. The two
never compute at once (the learner computes on ``LearnerConfig.threads`` torch threads, default 1:
why not on every core, :mod:`onlinespec.online.budget`).

When no request is waiting the engine gives turn after turn (learning at full speed, a new
request waiting at most one unit of work). Under load it gives one only while the share of its
wall time spent learning, over the last ``window_seconds``, is below ``share`` (the operator's
``--learn-share``, or less if a controller lowers it) times the **headroom**: the share of its
serving time, over the same window, spent in steps where a draft could pay at all. A step of a
batch so large that a wider forward costs about what its extra tokens bring (compute-bound: on
llama.cpp here, 8 requests) gains nothing from any draft, so learning under that load would be
spent for nothing. The share actually spent and the headroom are on /metrics.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

SLICE_SECONDS = 0.05  # a turn: units of work until this much time has passed (a unit is never cut)
WINDOW_SECONDS = 30.0  # the share spent is measured over about this long (an exponential window)
GRANTED = -1  # the turn's holder between the engine's grant and a learner thread taking it
SUSPENDED_GAP = 1.0  # the engine wakes every 0.1 s while a turn runs: a longer gap is the process suspended, not learning


class EngineTurns:
    """Turns of compute between the engine (one thread) and learner threads (at most one at a time
    holds the turn). Learners call :meth:`take` before their first unit of work, :meth:`checkpoint`
    between units and :meth:`done` at the end; the engine calls :meth:`give` when :meth:`wanted`."""

    def __init__(self, share: float, slice_seconds: float = SLICE_SECONDS, window_seconds: float = WINDOW_SECONDS,
                 on_wanted: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"the learning share must lie in (0, 1], got {share}")
        self.share, self.limit = share, share  # what the engine gives now (a controller may lower it), and the operator's cap
        self.slice_seconds, self.window_seconds = slice_seconds, window_seconds
        self.on_wanted, self.clock = on_wanted, clock
        self._cond = threading.Condition()
        self._waiting = 0  # learner threads waiting for a turn
        self._holder: int | None = None  # the thread holding the turn
        self._until = 0.0  # the turn's end
        self._closed = False  # shutting down: learners run without turns (a drain must finish)
        self._learn = self._serve = 0.0  # seconds in the window (decayed)
        self._payable = 0.0  # of _serve, in steps where a draft could pay (the headroom's numerator)
        self._at = clock()
        self.learn_seconds_total = 0.0
        self.turns_total = 0
        self.longest_turn_seconds = 0.0  # a unit is never cut: the longest turn is the most a step waited for learning

    # ---- the learner's side --------------------------------------------------------------------

    def take(self, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Wait for a turn (or for ``cancelled()``, or for :meth:`close`)."""
        me = threading.get_ident()
        with self._cond:
            if self._holder == me or self._closed:
                return
            self._waiting += 1
            self.on_wanted()
            try:
                while not self._closed and not cancelled():
                    if self._holder == GRANTED:  # the engine gave a turn: the first waiting learner takes it
                        self._holder = me
                        return
                    self._cond.wait(0.1)
            finally:
                self._waiting -= 1

    def checkpoint(self, cancelled: Callable[[], bool] = lambda: False) -> float:
        """Between two units of work: go on while the turn lasts, else hand it back and wait for
        the next; the seconds it waited."""
        with self._cond:
            if self._holder != threading.get_ident() or self.clock() < self._until:
                return 0.0
        self.done()
        start = self.clock()
        self.take(cancelled)
        return self.clock() - start

    def done(self) -> None:
        """Hand the turn back (the update ended, or the turn ran out)."""
        with self._cond:
            if self._holder == threading.get_ident():
                self._holder = None
                self._cond.notify_all()

    # ---- the engine's side ---------------------------------------------------------------------

    def wanted(self) -> bool:
        """A learner waits for a turn."""
        return self._waiting > 0 and not self._closed

    def due(self) -> bool:
        """Under load: whether the share spent over the window leaves room for a turn."""
        self._decay()
        total = self._learn + self._serve
        return self.wanted() and (total == 0.0 or self._learn / total < self.share * self.headroom())

    def served(self, seconds: float, payable: bool = True) -> None:
        """The engine spent ``seconds`` serving (a step); ``payable``: at a batch size where a draft
        could pay (:func:`onlinespec.decoding.adaptive.could_pay`)."""
        self._decay()
        self._serve += seconds
        self._payable += seconds if payable else 0.0

    def headroom(self) -> float:
        """The share of the serving time over the last window spent in steps where a draft could
        pay (1 before any step)."""
        return self._payable / self._serve if self._serve > 0.0 else 1.0

    def give(self) -> float:
        """Give one turn to a waiting learner and wait until it hands it back; the seconds it took."""
        start = last = self.clock()
        suspended = 0.0  # a process stopped mid-turn (SIGSTOP, a frozen container) did not spend that time learning
        with self._cond:
            if not self.wanted():
                return 0.0
            self._holder, self._until = GRANTED, start + self.slice_seconds
            self._cond.notify_all()
            while self._holder is not None and not self._closed:
                if self._holder == GRANTED and self._waiting == 0:  # the learner gave up waiting (cancelled)
                    self._holder = None
                    break
                self._cond.wait(0.1)
                now = self.clock()
                if now - last > SUSPENDED_GAP:
                    suspended += now - last - 0.1
                last = now
        seconds = self.clock() - start - suspended
        self._decay()
        self._learn += seconds
        self.learn_seconds_total += seconds
        self.turns_total += 1
        self.longest_turn_seconds = max(self.longest_turn_seconds, seconds)
        return seconds

    def spent(self) -> float:
        """The share of the engine's wall time spent learning over the last window."""
        self._decay()
        total = self._learn + self._serve
        return self._learn / total if total else 0.0

    def close(self) -> None:
        """Shutting down: every learner runs freely from now on (a drain must end)."""
        with self._cond:
            self._closed = True
            self._holder = None
            self._cond.notify_all()

    # ---- internals -------------------------------------------------------------------------------

    def _decay(self) -> None:
        now = self.clock()
        factor = math.exp(-(now - self._at) / self.window_seconds)
        self._learn, self._serve, self._payable, self._at = self._learn * factor, self._serve * factor, self._payable * factor, now
