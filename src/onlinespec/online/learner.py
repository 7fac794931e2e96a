"""The online learner (arXiv 2310.07177, section 4.2): every I requests, distil a private copy of the serving
draft on the replay buffer in the background, gate it on held-out recent records of every domain, publish it to
the registry and hand it to the proposer, which takes it between two rounds.

The serving path only appends a record and counts (``observe``); it never waits for an update.
An update that is still running when the next one is due is not stacked: the next one starts
when the current one ends and the count is reached again.

:class:`OnlineLearner` is the serving and operator side: it records, counts, starts, stops and
steers updates. It composes one collaborator per job: the update's CPU budget
(:mod:`onlinespec.online.budget`), what serves and what the registry says
(:mod:`onlinespec.online.publisher`), and the update itself (:mod:`onlinespec.online.update`:
training a candidate, :mod:`onlinespec.online.trainer`; judging it, :mod:`onlinespec.online.gate`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from onlinespec.decoding.proposers.base import SwappableDraft
from onlinespec.decoding.speculative import Generation
from onlinespec.online.budget import UpdateBudget
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.config import PRIORITIES, UNITS, LearnerConfig
from onlinespec.online.learnable import LearnableDraft, learnable
from onlinespec.online.publisher import Publisher, load_version
from onlinespec.online.recorder import records_from_generation
from onlinespec.online.registry import DraftRegistry
from onlinespec.online.turns import EngineTurns
from onlinespec.online.update import Updater, UpdateReport

# all but OnlineLearner live in config.py, update.py and publisher.py now, and import from here as before
__all__ = ["PRIORITIES", "UNITS", "LearnerConfig", "OnlineLearner", "UpdateReport", "load_version"]

log = logging.getLogger("onlinespec.learner")


class OnlineLearner:
    def __init__(
        self,
        proposer: SwappableDraft,
        buffer: ReplayBuffer,
        registry: DraftRegistry,
        config: LearnerConfig | None = None,
        background: bool = True,
        on_event: Callable[[dict], None] | None = None,
        slot: threading.Semaphore | None = None,
        identity: dict | None = None,
        origin: dict | None = None,
        turns: EngineTurns | None = None,
    ) -> None:
        """``on_event`` is called from the learner thread when an update starts and when it ends.
        ``slot``: shared by the learners of several drafts, so that one update runs at a time
        (each has the CPU budget to itself); a due update waits for it, it is never dropped.
        ``identity`` (target, draft spec, tokenizer) goes into every published version's
        metadata; a registry written for another identity is refused. ``origin``: where the
        proposer's weights came from, for an empty registry's first version (default: the starting
        draft; a draft spawned by the content router names the draft and version it copied). ``turns``: the serving engine's (:mod:`onlinespec.online.turns`):
        the update thread computes only in turns the engine gives it, never beside a step."""
        self.proposer, self.buffer, self.registry = proposer, buffer, registry
        self.on_event, self.slot = on_event or (lambda event: None), slot
        self.config = config = config or LearnerConfig()
        self.background = background
        self.turns = turns  # the serving engine's turns: the update computes only in them (onlinespec.online.turns)
        self.identity = identity or {}
        self.learnable: LearnableDraft = learnable(proposer.model)
        self._count = 0
        self._records_seen = 0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the buffer between serving and learner threads
        self._cancel = threading.Event()
        self.failures: list[str] = []  # updates that raised (the serving path never sees their errors)
        self.consecutive_failures = 0
        self.stopped: str | None = None  # why the learner gave up (max_failures in a row); serving goes on
        self.write_failures = 0  # records a failed disk write skipped
        self.pinned = False  # an operator pinned the serving version: updates still run, none publishes
        self.due_since: float | None = None  # when the update now due fell due (time.monotonic)
        self.backoff = 1  # updates every backoff x I units: set by the controller when updates stop earning (onlinespec.online.controller)
        self._record_credit = 0.0  # records_next: a request is recorded each time this reaches 1
        self._record_lock = threading.Lock()
        self.publisher = Publisher(proposer, registry, self.identity, origin, config.keep_versions)
        self.budget = UpdateBudget(config, background, turns, self._cancel.is_set)
        self.updater = Updater(config, self.learnable, buffer, self._lock, self.publisher, self.budget, self._cancel,
                               lambda event: self.on_event(event), lambda: self.pinned, self.identity)  # on_event may be swapped later
        self.reports: list[UpdateReport] = self.updater.reports
        if len(registry.versions()) > 1:  # it learnt online before this process: no shifted updates until a drift
            self.updater.trainer.schedule.resume()

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken by all updates (cancelled ones included)."""
        return self.updater.trainer.steps_done

    @property
    def pruned(self) -> list[str]:
        """Versions deleted by ``keep_versions``."""
        return self.publisher.pruned

    def observe(
        self, generation: Generation, domain: str = "default", request_id: str = "", train: bool = True, start: bool = True,
    ) -> bool:
        """Record a served request and, with ``start``, start an update when due (a pool of drafts
        starts it itself, in the order the updates fell due). ``train=False`` (the client opted
        out): nothing is stored and the request does not count towards the interval. Returns
        whether every record is durable; a record whose write fails (a full disk) is skipped and
        counted, and serving goes on."""
        if not train:
            return False
        return self.observe_records(self.records(generation, domain, request_id), len(generation.token_ids), start)

    def records(self, generation: Generation, domain: str = "default", request_id: str = "") -> list:
        """A served request's training records, by this learner's position policy and sampling mode."""
        config = self.config
        return records_from_generation(generation, config.position_policy, config.sampling, domain, request_id)

    def observe_records(self, records: list, new_tokens: int, start: bool = True) -> bool:
        """Store a served request's records (:meth:`records`) and count it: see :meth:`observe`."""
        stored = True
        with self._lock:
            for record in records:
                try:
                    stored = self.buffer.add(record) and stored  # False: the policy turned it away (reservoir)
                except OSError as err:
                    stored = False
                    self.write_failures += 1
                    log.error("draft %s: a record of request %s was not stored (%s); serving goes on",
                              self.registry.directory.name, record.request_id, err)
            self._records_seen += len(records)
            unit = self.config.interval_unit
            self._count += {"requests": 1, "records": len(records), "tokens": new_tokens}[unit]
        if self.due and self.due_since is None:
            self.due_since = time.monotonic()
        if start:
            self.maybe_update()
        return stored

    def records_next(self, headroom: float = 1.0) -> bool:
        """Whether the next request this draft serves is traced and recorded: a share
        ``headroom / backoff`` of them, evenly (every one at the full rate and full headroom, one
        in ``backoff`` while its updates back off). ``headroom``: the share of the engine's time at
        loads where a draft could pay (:meth:`onlinespec.online.turns.EngineTurns.headroom`). An
        update then still learns from about I requests' records at full headroom, while what
        recording costs the engine (the target's top-K and features at every verified position,
        the records, their durable writes: about 4% of llama.cpp's tokens/s at 8 in flight,
        ``bench/online_overhead.py``) falls with the update rate and with what learning could
        earn. A request left unrecorded still counts towards the interval and feeds the suffix index."""
        with self._record_lock:
            self._record_credit += max(0.0, min(1.0, headroom)) / self.backoff
            if self._record_credit >= 1.0 - 1e-9:
                self._record_credit -= 1.0
                return True
            return False

    @property
    def due(self) -> bool:
        """I units have been served since the last update started (never once the learner stopped)."""
        return self.stopped is None and self._count >= self.config.update_interval * self.backoff

    def hurry(self) -> None:
        """Make the next update due now instead of after I units (a detected drift); it starts
        at the next request, as soon as the shared slot is free, and the next updates take the
        shifted phase's larger steps (:mod:`onlinespec.online.schedule`)."""
        with self._lock:
            self.backoff = 1  # a drift: learning pays again
            self.updater.trainer.schedule.shifted()
            self._count = max(self._count, self.config.update_interval)
        if self.due and self.due_since is None:
            self.due_since = time.monotonic()
        self.on_event({"event": "hurried", "time": time.time()})

    def maybe_update(self) -> bool:
        """Start the update that is due, if this learner and the shared slot are free (serving thread)."""
        return self.due and self._begin()

    def update_now(self) -> bool:
        """Start an update now, whatever the count (an operator's request, which also restarts a
        learner that stopped after failures); the count starts again. False if this learner or
        the shared slot is busy."""
        if self.busy:
            return False
        stopped, failures = self.stopped, self.consecutive_failures
        self.stopped, self.consecutive_failures = None, 0
        if self._begin():
            return True
        self.stopped, self.consecutive_failures = stopped, failures
        return False

    def _begin(self) -> bool:
        if self.start_update():
            self._count, self.due_since = 0, None
            return True
        return False

    def start_update(self) -> bool:
        """Start an update now (in the background thread when ``background``); False if this
        learner, or another holding the shared slot, is running one."""
        if self.busy or (self.slot is not None and not self.slot.acquire(blocking=False)):
            return False
        if self.background:
            self._thread = threading.Thread(target=self._update, name="onlinespec-learner", daemon=True)
            self._thread.start()
        else:
            self._update()
        return True

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the update in flight (if any) ends: for shutdown and tests, never serving."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Abandon the update in flight (it publishes nothing) and wait for its thread to end."""
        self._cancel.set()
        self.wait(timeout)
        if not self.busy:  # still running past the timeout (shutdown): it stays cancelled
            self._cancel.clear()

    def serve_version(self, version: str) -> None:
        """Serve a published ``version`` from the next step on (a rollback, or pinning an older
        one): the update in flight is abandoned, and the next update starts from ``version``."""
        model = self.publisher.load(version)  # before stopping anything: a version that fails to load changes nothing
        self.stop()
        self.publisher.serve(model, version)
        self.updater.trainer.forget()

    def follow_registry(self) -> str | None:
        """Serve the version another process made CURRENT (``onlinespec drafts rollback`` while
        this one serves); the version now served if it changed, else None. Never waits for a
        publish in flight (the next call looks again); a version that fails to load is tried once."""
        current = self.publisher.changed()
        if current is None:
            return None
        try:
            self.serve_version(current)
        except Exception as err:
            self.publisher.unloadable = current
            log.error("draft %s: CURRENT names %s, which could not be served (%s); serving %s", self.registry.directory.name,
                      current, err, self.publisher.current)
            return None
        self.on_event({"event": "rollback", "version": current, "by": "another process (CURRENT changed)", "time": time.time()})
        return current

    # ---- the replay buffer, for housekeeping and operators ------------------------------------

    def expire(self) -> int:
        """Drop the records past the buffer's retention (housekeeping); how many went."""
        with self._lock:
            return self.buffer.expire()

    def purge(self, request_id: str | None = None, before: float | None = None) -> int:
        """Delete a request's records (or those recorded before ``before``); how many went."""
        with self._lock:
            return self.buffer.purge(request_id, before)

    def governance(self) -> dict:
        """What this learner's buffer and registry did with the training data (counts)."""
        return {**self.buffer.counts, "quarantined": self.buffer.counts["quarantined"] + len(self.registry.quarantined),
                "held": len(self.buffer), "bytes": self.buffer.nbytes, "write_failures": self.write_failures,
                "versions_pruned": len(self.pruned)}

    # ---- the update (learner thread): the budget, the update (onlinespec.online.update), its failures ----

    def _update(self) -> None:
        serving_threads = torch.get_num_threads()
        try:
            self.budget.enter()
            with self._lock:
                records, records_seen = self.buffer.records(), self._records_seen
            self.updater.run(records, records_seen)
            self.consecutive_failures = 0
        except Exception as err:  # an update that fails publishes nothing and never stops serving
            log.debug("draft %s: the update's traceback", self.registry.directory.name, exc_info=err)
            self._failed(f"{type(err).__name__}: {err}")
        finally:
            self.budget.give_turn_back()
            if self.slot is not None:
                self.slot.release()
            self.budget.leave(serving_threads)

    def _failed(self, error: str) -> None:
        self.failures.append(error)
        self.consecutive_failures += 1
        log.error("draft %s: an update failed (%s); serving goes on", self.registry.directory.name, error)
        self.on_event({"event": "update_failed", "error": error, "parent": self.publisher.latest[1], "time": time.time()})
        if self.consecutive_failures >= self.config.max_failures:
            self.stopped = (f"{self.consecutive_failures} updates failed in a row (the last: {error}); learning stopped, "
                            "serving goes on with the last published version: fix the cause, then start an update (admin API)")
            log.error("draft %s: %s", self.registry.directory.name, self.stopped)
            self.on_event({"event": "learner_stopped", "reason": self.stopped, "time": time.time()})

