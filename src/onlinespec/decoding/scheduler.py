"""Continuous batching: admit waiting requests into the engine's batch as slots free up.

A request waits in a first-come queue until fewer than ``max_batch`` requests are running; it then
joins at the next step (its prompt prefilled in chunks, :mod:`onlinespec.decoding.engine`) and
leaves as soon as it finishes, so the next one takes its slot at once. ``submit`` may be called
from any thread; ``step`` from one thread only (the engine's loop). A step that raises is
recovered once (:meth:`~onlinespec.decoding.engine.SpeculativeEngine.recompute`); a second in
a row is raised to the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from onlinespec.decoding.engine import SpeculativeEngine, StepReport
from onlinespec.decoding.request import RequestState

DEFAULT_MAX_BATCH = 8  # requests verified per step


class Scheduler:
    def __init__(self, engine: SpeculativeEngine, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine, self.max_batch = engine, max_batch
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self._lock = threading.Lock()
        self.failed_steps = 0  # engine steps that raised in a row

    def submit(self, request: RequestState) -> RequestState:
        with self._lock:
            self.waiting.append(request)
        return request

    def cancel(self, request: RequestState) -> None:
        """Drop a request (a client that went away); its slot frees at the next step."""
        with self._lock:
            if request in self.waiting:
                self.waiting.remove(request)
            if request in self.running:
                self.running.remove(request)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> tuple[list[RequestState], StepReport | None]:
        """Admit, run one engine step; return the requests it advanced (finished ones included)."""
        with self._lock:
            while self.waiting and len(self.running) < self.max_batch:
                request = self.waiting.popleft()
                request.stats.queued_seconds = time.perf_counter() - request.submitted
                self.running.append(request)
            active = list(self.running)
        if not active:
            return [], None
        try:
            report = self.engine.step(active)
            self.failed_steps = 0
        except Exception:
            self.failed_steps += 1
            if self.failed_steps > 1:  # twice in a row: not one request's doing
                raise
            # a batched forward raised and cannot say whose fault it was: every request prefills
            # its text again next step, each in a forward of its own, where a culprit fails alone
            logging.getLogger("onlinespec.scheduler").exception("a step failed: its %d requests recompute", len(active))
            self.engine.recompute(active)
            return [], None
        with self._lock:
            self.running = [r for r in self.running if not r.finished]
        return active, report

    def run(self) -> list[StepReport]:
        """Step until every submitted request has finished."""
        reports = []
        while self.has_work:
            _, report = self.step()
            if report is not None:
                reports.append(report)
        return reports
