# Over 500 lines: the update loop, its gate, and its two CPU budgets (the engine's turns, or a thread at a priority) in one place.
"""The online learner (arXiv 2310.07177, section 4.2): every I requests, distil a private copy of the serving
draft on the replay buffer in the background, gate it on held-out recent records of every domain, publish it to
the registry and hand it to the proposer, which takes it between two rounds.

The serving path only appends a record and counts (``observe``); it never waits for an update.
An update that is still running when the next one is due is not stacked: the next one starts
when the current one ends and the count is reached again.

CPU budget. The learner thread runs ``threads`` torch threads. At ``priority="low"`` (the
default) the OS runs it at the lowest priority (nice 19, for that thread only), so it takes only
the CPU time serving leaves: on a 2-core machine that serving saturates, an update takes longer
but requests keep their speed (docs/learner-overhead.md and docs/online-experiments.md measure both). ``cpu_share`` caps the share of
wall time the learner computes (it sleeps between steps), for machines where it runs at normal
priority.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from safetensors import SafetensorError

from onlinespec.cpu import lower_priority, name_thread
from onlinespec.decoding.feature_head import CHAIN_DEPTH
from onlinespec.decoding.proposers.base import SwappableDraft
from onlinespec.decoding.speculative import Generation
from onlinespec.distill.loop import run_steps
from onlinespec.distill.step import DistillConfig
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.gate import NextGate
from onlinespec.online.learnable import LearnableDraft, learnable
from onlinespec.online.recorder import POSITION_POLICIES, SAMPLING_MODES, records_from_generation
from onlinespec.online.registry import DraftRegistry
from onlinespec.online.turns import EngineTurns
from onlinespec.storage import kill_point

UNITS = ("requests", "records", "tokens")
_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


def return_freed_memory() -> None:
    """Hand the heap an update freed back to the OS (glibc's ``malloc_trim``; elsewhere nothing).
    An update's tensors grow with the replay buffer and are freed when it ends, but glibc keeps
    freed pages in the learner thread's arena: without this the server's resident memory keeps
    every update's high-water mark (docs/reliability.md, the soak)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
log = logging.getLogger("onlinespec.learner")


@dataclass
class LearnerConfig:
    update_interval: int = 25  # I
    interval_unit: str = "requests"  # requests | records | tokens (generated tokens)
    position_policy: str = "verified"  # which verified positions become training rows (recorder; the paper: rejected)
    distill: DistillConfig = field(default_factory=DistillConfig)
    steps_per_update: int = 40
    batch_size: int = 32  # examples per step: chain starts for a feature head, records for a draft LM
    lr: float = 5e-5  # measured best of 3e-4, 1e-4, 5e-5 on a familiar and an unseen domain (docs/faster-drafts.md)
    cold_lr: float = 1e-3  # a draft that starts from nothing (a fresh head): the offline warm-up's rate (docs/drafts.md)
    cold_steps: int = 4  # and this many times steps_per_update: +0.02-0.05 step-1 alpha by request 300 (bench/fresh_head_data.py)
    gate_fraction: float = 0.2  # the newest share of the buffer's records, held out to judge a candidate
    gate_margin: float = 0.0  # publish if candidate alpha >= serving alpha - margin
    gate: str = "holdout"  # holdout: judge on the newest gate_fraction held out of training; next: train on
    # every record, judge on the records served after it (onlinespec.online.gate)
    gate_metric: str = "auto"  # replayed: what the hybrid proposer serving with each draft accepts over the
    # judged records, replayed (a feature head; agreed with the truth on 14-15 of 20 candidates where alpha
    # agreed on 10, docs/faster-drafts.md section 3); alpha: teacher-forced step-1 alpha (a draft LM always);
    # auto: replayed, but alpha while a head is cold (born from the target: nearly every candidate gains, and on
    # the cold start the alpha gate's cheaper updates served 0.48 against 0.36 by request 300, docs/online-learning.md)
    gate_by: str = "domain"  # domain: hold out the newest share of EACH domain's records, and publish only
    # if the candidate loses on none of them (a draft tuned to the newest traffic must not serve the rest
    # worse); newest: the newest share of all records, judged pooled
    sampling: str = "teacher"  # sampling mode of the training signal: teacher | student | mixed (recorder)
    threads: int = 1  # torch threads of the learner thread (serving keeps the rest)
    priority: str = "low"  # low: nice 19 (the OS runs the learner mostly on CPU time serving leaves); idle:
    # SCHED_IDLE (a serving thread that wakes takes the core at once); normal (see lower_priority)
    cpu_share: float = 1.0  # the most wall time the learner computes (it sleeps the rest)
    chain_depth: int = CHAIN_DEPTH  # feature heads: draft steps unrolled in training
    max_failures: int = 3  # updates failing in a row before the learner stops trying (serving goes on)
    keep_versions: int = 0  # keep this many newest registry versions (plus the current one and its parent); 0: all

    def __post_init__(self) -> None:
        if self.position_policy not in POSITION_POLICIES:
            raise ValueError(f"unknown position policy {self.position_policy!r}: use one of {POSITION_POLICIES}")
        if not (math.isfinite(self.lr) and self.lr > 0 and math.isfinite(self.cold_lr) and self.cold_lr > 0):
            raise ValueError(f"the learning rate must be a positive number, got lr {self.lr}, cold_lr {self.cold_lr}")
        if not 0.0 < self.gate_fraction < 1.0:
            raise ValueError(f"gate_fraction must lie in (0, 1), got {self.gate_fraction}")
        if not (math.isfinite(self.gate_margin) and self.gate_margin >= 0):
            raise ValueError(f"gate_margin must be >= 0, got {self.gate_margin}")
        if self.batch_size < 1 or self.chain_depth < 1 or self.max_failures < 1 or self.keep_versions < 0:
            raise ValueError("batch_size, chain_depth and max_failures must be >= 1, keep_versions >= 0")
        if self.interval_unit not in UNITS:
            raise ValueError(f"unknown interval unit {self.interval_unit!r}: use one of {UNITS}")
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(f"unknown sampling mode {self.sampling!r}: use one of {SAMPLING_MODES}")
        if self.gate not in ("holdout", "next"):
            raise ValueError(f"gate must be 'holdout' or 'next', got {self.gate!r}")
        if self.gate_metric not in ("auto", "replayed", "alpha"):
            raise ValueError(f"gate_metric must be 'auto', 'replayed' or 'alpha', got {self.gate_metric!r}")
        if self.gate_by not in ("domain", "newest"):
            raise ValueError(f"gate_by must be 'domain' or 'newest', got {self.gate_by!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {self.priority!r}")
        if not 0.0 < self.cpu_share <= 1.0:
            raise ValueError(f"cpu_share must lie in (0, 1], got {self.cpu_share}")
        if self.update_interval < 1 or self.steps_per_update < 1 or self.cold_steps < 1 or self.threads < 1:
            raise ValueError("update_interval, steps_per_update, cold_steps and threads must be >= 1")


PRIORITIES = ("low", "idle", "normal")


def load_version(model: torch.nn.Module, registry: DraftRegistry, version: str) -> torch.nn.Module:
    """A private copy of ``model`` (a serving draft) holding ``version``'s weights."""
    copied = learnable(model).copy(model)
    learnable(model).load(copied, registry.load(version), f"the weights of {registry.directory.name} {version}")
    return copied.eval()


DOMAIN_NOISE = 2.0  # standard errors a held-out domain's alpha may fall by in the gate (LearnerConfig.gate_by="domain")


def paired_error(before: dict, after: dict) -> float:
    """The standard error of the difference in the gate's figure between two drafts scored on the
    same records: of the mean per-position difference in alpha (``alphas``), or, for the replayed
    figure (``requests``: each record's [accepted, judged]), of the difference of two ratios
    sum(accepted) / sum(judged), by the delta method over records. 0 without those figures, or
    under two positions or records."""
    if "requests" in before and "requests" in after:
        b, a = before["requests"].double(), after["requests"].double()
        if len(b) < 2:
            return 0.0
        def influence(x):  # each record's share of the ratio's error
            total = x[:, 1].sum().clamp_min(1)
            return (x[:, 0] - x[:, 0].sum() / total * x[:, 1]) / total
        diff = influence(a) - influence(b)
        return float((diff.pow(2).sum() * len(diff) / (len(diff) - 1)).sqrt())
    if "alphas" not in before or "alphas" not in after or len(before["alphas"]) < 2:
        return 0.0
    diff = (after["alphas"] - before["alphas"]).double()
    return float(diff.std() / len(diff) ** 0.5)


@dataclass
class UpdateReport:
    version: str | None  # published version, or None when the gate refused the candidate
    parent: str
    records_seen: int
    loss_before: float
    loss_after: float
    alpha_before: float  # on the held-out records, serving draft
    alpha_after: float  # candidate
    seconds: float
    examples: int = 0  # training examples the update drew from (records, or chain starts for a head)
    by_domain: dict = field(default_factory=dict)  # gate_by="domain": {domain: [figure before, after]} (gate_metric)
    ended_at: float = 0.0  # wall-clock time
    outcome: str = ""  # published | refused (by the gate) | pinned (passed the gate, not published: a version is pinned)
    # | superseded (passed, but another process changed the registry's CURRENT meanwhile: its choice stands)
    engine_seconds: float = 0.0  # the compute time it took (its wall time less its waits for the engine's turns)
    steps: int = 0  # optimizer steps it took (a draft born from the target takes LearnerConfig.cold_steps times more)
    cold: bool = False  # the draft was born from the target (LearnableDraft.cold): the learning controller judges it by alpha
    gate_metric: str = "alpha"  # the figure the gate decided by (LearnerConfig.gate_metric; alpha for a draft LM)
    replayed_before: float | None = None  # gate_metric replayed: the serving draft's replayed figure on the held-out records
    replayed_after: float | None = None  # the candidate's


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
        the update thread computes only in turns the engine gives it, on every core, never beside a step."""
        self.proposer, self.buffer, self.registry = proposer, buffer, registry
        self.on_event, self.slot = on_event or (lambda event: None), slot
        self.config = config or LearnerConfig()
        self.background = background
        self.turns = turns  # the serving engine's turns: the update computes only in them (onlinespec.online.turns)
        self.identity = identity or {}
        self.learnable: LearnableDraft = learnable(proposer.model)
        self.reports: list[UpdateReport] = []
        self._count = 0
        self._records_seen = 0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the buffer between serving and learner threads
        self._registry_lock = threading.Lock()  # a publish, and noticing another process's CURRENT
        self._cancel = threading.Event()
        self.steps_done = 0  # optimizer steps taken by all updates (cancelled ones included)
        self.failures: list[str] = []  # updates that raised (the serving path never sees their errors)
        self.consecutive_failures = 0
        self.stopped: str | None = None  # why the learner gave up (max_failures in a row); serving goes on
        self.write_failures = 0  # records a failed disk write skipped
        self.pruned: list[str] = []  # versions deleted by keep_versions
        self.pinned = False  # an operator pinned the serving version: updates still run, none publishes
        self._unloadable: str | None = None  # a version another process made CURRENT that would not load
        self.due_since: float | None = None  # when the update now due fell due (time.monotonic)
        self._waited = 0.0  # seconds the update in flight waited for the engine's turns
        self.backoff = 1  # updates every backoff x I units: set by the controller when updates stop earning (onlinespec.online.controller)
        self._record_credit = 0.0  # records_next: a request is recorded each time this reaches 1
        self._record_lock = threading.Lock()
        current = self._recover()
        if current is None:
            registry.publish(proposer.model.state_dict(), {"parent": None, "records_seen": 0, "note": "starting draft",
                                                           **(origin or {}), "identity": self.identity})
            proposer.version = registry.current()
        # the newest published draft: the next update starts from it even if the proposer has not
        # taken it yet (it swaps between rounds), so no update's work is ever dropped
        self._latest = (proposer.model, proposer.version)
        self._current = proposer.version  # the version this process last made CURRENT
        self._optimizer_state: dict | None = None  # the optimizer of the newest published draft
        self._next = NextGate()  # gate="next": the candidate waiting for the requests served after it

    def _recover(self) -> str | None:
        """A restart (or a rollback): serve the registry's current version, not the starting
        draft; an unreadable version is quarantined and the newest valid one served."""
        while (current := self.registry.recover()) is not None:
            self.registry.check_identity(self.identity)
            try:
                model = self._load_version(current)
            except SafetensorError as err:  # its file is unreadable: never serve it (other errors are raised)
                self.registry.quarantine(current, f"{type(err).__name__}: {err}")
                continue
            self.proposer.swap_model(model, current)
            self.proposer.take_swap()  # take it now: nothing is being served yet
            return current
        return None

    def _load_version(self, version: str):
        return load_version(self.proposer.model, self.registry, version)

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
        at the next request, as soon as the shared slot is free."""
        with self._lock:
            self.backoff = 1  # a drift: learning pays again
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
        model = self._load_version(version)  # before stopping anything: a version that fails to load changes nothing
        self.stop()
        with self._registry_lock:
            self.registry.set_current(version)
            self._current = version
        self.proposer.swap_model(model, version)
        self._latest, self._optimizer_state = (model, version), None

    def follow_registry(self) -> str | None:
        """Serve the version another process made CURRENT (``onlinespec drafts rollback`` while
        this one serves); the version now served if it changed, else None. Never waits for a
        publish in flight (the next call looks again); a version that fails to load is tried once."""
        if not self._registry_lock.acquire(blocking=False):
            return None
        try:
            current = self.registry.current()
            if not current or current in (self._current, self._unloadable) or current not in self.registry.versions():
                return None
        except OSError:
            return None
        finally:
            self._registry_lock.release()
        try:
            self.serve_version(current)
        except Exception as err:
            self._unloadable = current
            log.error("draft %s: CURRENT names %s, which could not be served (%s); serving %s", self.registry.directory.name,
                      current, err, self._current)
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

    def score(self) -> None:
        """Priority policy: the serving draft's loss on every buffered record (hardest kept)."""
        with self._lock:
            records = self.buffer.records()
        model, distill = self._latest[0], self.config.distill
        scored = [(r, self.learnable.metrics(model, [r], distill)["loss"]) for r in records]
        with self._lock:
            self.buffer.set_priorities(scored)

    # ---- the update (learner thread): snapshot, train, gate, publish, hand over -------------------

    def _held_out(self, records: list) -> tuple[list, dict[str, list]]:
        """(training records, held-out groups): the newest ``gate_fraction`` of each domain's
        records (``gate_by="domain"``; a domain with a single record is only judged), or of all
        records in one group (``"newest"``)."""
        fraction = self.config.gate_fraction
        if self.config.gate_by == "newest":
            n = max(1, int(len(records) * fraction))
            return records[:-n], {"all": records[-n:]}
        by_domain: dict[str, list] = {}
        for record in records:
            by_domain.setdefault(record.domain, []).append(record)
        groups = {d: rs[-max(1, int(len(rs) * fraction)):] for d, rs in by_domain.items()}
        held = {id(r) for rs in groups.values() for r in rs}
        return [r for r in records if id(r) not in held], groups

    def _budget(self) -> None:
        """The learner thread's CPU budget: its torch threads and its priority; in the engine's
        turns, every core (serving waits meanwhile) and no lower priority."""
        if self.background:
            name_thread("onlinespec-learn")
        if self.turns is not None:
            torch.set_num_threads(len(os.sched_getaffinity(0)))
            self.turns.take(self._cancel.is_set)
            return
        torch.set_num_threads(self.config.threads)
        if self.background:
            lower_priority(self.config.priority)

    def _pause_point(self) -> None:
        """Between two units of work (an optimizer step, an evaluation): the engine's turn, if it ran out."""
        if self.turns is not None:
            self._waited += self.turns.checkpoint(self._cancel.is_set)

    def _update(self) -> None:
        serving_threads = torch.get_num_threads()
        try:
            self._budget()
            self._run_update()
            self.consecutive_failures = 0
        except Exception as err:  # an update that fails publishes nothing and never stops serving
            self._failed(f"{type(err).__name__}: {err}")
        finally:
            if self.turns is not None:
                self.turns.done()
            if self.slot is not None:
                self.slot.release()
            if not self.background:  # the update ran on the serving thread: give it its threads back
                torch.set_num_threads(serving_threads)
            return_freed_memory()

    def _failed(self, error: str) -> None:
        self.failures.append(error)
        self.consecutive_failures += 1
        log.error("draft %s: an update failed (%s); serving goes on", self.registry.directory.name, error)
        self.on_event({"event": "update_failed", "error": error, "parent": self._latest[1], "time": time.time()})
        if self.consecutive_failures >= self.config.max_failures:
            self.stopped = (f"{self.consecutive_failures} updates failed in a row (the last: {error}); learning stopped, "
                            "serving goes on with the last published version: fix the cause, then start an update (admin API)")
            log.error("draft %s: %s", self.registry.directory.name, self.stopped)
            self.on_event({"event": "learner_stopped", "reason": self.stopped, "time": time.time()})

    def _run_update(self) -> None:
        start = time.perf_counter()
        self._waited = 0.0
        with self._lock:
            records, records_seen = self.buffer.records(), self._records_seen
        if len(records) < 2:
            return
        self.on_event({"event": "update_start", "records": len(records), "parent": self._latest[1], "time": time.time()})
        serving, parent = self._latest
        if self.config.gate == "next":  # judge the pending candidate on the records served since it trained
            trained = self._next.take(records, parent, self.config.gate_by)
            if trained is None:
                return self._next.train(self, records)
            *trained, groups = trained
        else:
            train, groups = self._held_out(records)
            trained = self._train(serving, train)
        if trained is None:  # no example to train on, or cancelled
            return
        candidate, optimizer, examples, steps = trained
        cold = self.learnable.cold(serving)
        figure = self.gate_figure(cold)
        before, after, by_domain, passed = self._gate(serving, candidate, groups, figure)
        if self._cancel.is_set():  # shutdown or a rollback while it ran: never publish
            return
        version, outcome = None, "pinned" if passed and self.pinned else "refused"
        if passed and not self.pinned:
            version = self._publish(candidate, {
                "parent": parent, "records_seen": records_seen, "loss_before": before["loss"], "loss_after": after["loss"],
                "alpha_before": before["alpha"], "alpha_after": after["alpha"], "alpha_by_domain": by_domain,
                "gate_metric": figure, "replayed_before": before.get("replayed"), "replayed_after": after.get("replayed"),
                "config": asdict(self.config), "identity": self.identity,
            }, parent)
            outcome = "published" if version else "superseded"
        if version:
            self._hand_over(candidate, version, optimizer, records)
            self._prune()
        if self.buffer.policy == "priority":
            self.score()
        seconds = time.perf_counter() - start
        report = UpdateReport(version, parent, records_seen, before["loss"], after["loss"], before["alpha"], after["alpha"],
                              seconds, examples, by_domain, time.time(), outcome, seconds - self._waited, steps, cold,
                              figure, before.get("replayed"), after.get("replayed"))
        self.reports.append(report)
        self.on_event({"event": "update", **asdict(report), "time": time.time()})
        if self.config.gate == "next":
            self._next.train(self, records)  # the next candidate, from what serves now

    def _train(self, serving, records: list):
        """Train a private copy of ``serving`` on ``records``: (candidate, optimizer, examples
        drawn from, steps), or None if there is nothing to train on or the update was cancelled."""
        objective = self.learnable.objective(records, self.config.position_policy, self.config.chain_depth, self.config.distill)
        if not objective.examples:
            return None
        candidate = self.learnable.copy(serving)  # the serving draft is never touched
        self.learnable.adapt(candidate, records)
        cold = self.learnable.cold(serving)  # a draft nobody trained: the warm-up's rate, and more steps
        lr = self.config.cold_lr if cold else self.config.lr
        optimizer = torch.optim.AdamW([p for p in candidate.parameters() if p.is_floating_point()], lr=lr)
        if self._optimizer_state is not None:  # carry Adam's moments on: a fresh optimizer's first steps jump by ~lr everywhere
            optimizer.load_state_dict(self._optimizer_state)
            for group in optimizer.param_groups:
                group["lr"] = lr
        generator = torch.Generator().manual_seed(len(self.reports))
        n, size = len(objective.examples), min(self.config.batch_size, len(objective.examples))
        steps = self.config.steps_per_update * (self.config.cold_steps if cold else 1)
        batches = ([objective.examples[i] for i in torch.randint(n, (size,), generator=generator).tolist()] for _ in range(steps))
        share, tick = self.config.cpu_share, [time.perf_counter()]

        def after_step(i: int, loss: float) -> None:
            self.steps_done += 1
            self._pause_point()
            if share < 1.0 and self.turns is None:  # sleep so that computing takes at most `share` of wall time
                time.sleep((time.perf_counter() - tick[0]) * (1.0 - share) / share)
            tick[0] = time.perf_counter()

        run_steps(candidate, optimizer, objective.step, batches, stop=self._cancel.is_set, after_step=after_step)
        return None if self._cancel.is_set() else (candidate, optimizer, n, steps)

    def gate_figure(self, cold: bool) -> str:
        """The figure the gate decides by (``LearnerConfig.gate_metric``): 'auto' is the replayed
        acceptance, or alpha while the draft is ``cold``; a draft LM, which cannot be replayed
        without the target, is always judged by alpha."""
        metric = self.config.gate_metric
        if metric == "auto":
            metric = "alpha" if cold else "replayed"
        return metric if self.learnable.replays else "alpha"

    def _gate(self, serving, candidate, groups: dict[str, list], figure: str):
        """(serving's figures, the candidate's, {domain: [figure before, after]}, passed): the
        candidate passes if its ``figure`` (:meth:`gate_figure`: the replayed acceptance, or alpha) on the
        held-out records is no worse than the serving draft's (less ``gate_margin``), pooled and,
        with several domains, on each, where a domain may fall by its noise: ``DOMAIN_NOISE``
        standard errors of the two drafts' paired difference (a draft LM, which has no
        per-position figures: none). A domain holds out a few requests' positions; a candidate
        that gained 0.12 pooled was refused for -0.003 on one of three (docs/online-learning.md).
        A feature head's pooled figures come from its domains' (``LearnableDraft.pool``): each
        held-out record is measured, and replayed, once per draft."""
        metrics, distill, margin = self.learnable.metrics, self.config.distill, self.config.gate_margin
        held_out = [r for rs in groups.values() for r in rs]
        replay = figure == "replayed"

        def measured(model, records, per_position=False):
            self._pause_point()  # a chunk of positions is a unit of work
            return metrics(model, records, distill, between=self._pause_point, per_position=per_position, replay=replay)

        parts = {domain: (measured(serving, records, not replay), measured(candidate, records, not replay))
                 for domain, records in (groups.items() if len(groups) > 1 else ())}
        if parts and self.learnable.pool:  # the pool from each domain's figures: each record measured once
            before, after = (self.learnable.pool([pair[i] for pair in parts.values()]) for i in (0, 1))
        else:
            before, after = measured(serving, held_out), measured(candidate, held_out)
        passed, by_domain = after[figure] >= before[figure] - margin, {}
        for domain, (b, a) in parts.items():
            by_domain[domain] = [b[figure], a[figure]]
            passed = passed and a[figure] >= b[figure] - margin - DOMAIN_NOISE * paired_error(b, a)
        return before, after, by_domain, passed

    def _publish(self, candidate, meta: dict, parent: str) -> str | None:
        """Write the candidate to the registry and make it CURRENT, only if its parent is still
        what is served: None if an operator rolled back meanwhile (here or from another
        process: CURRENT is compared and set under the registry's lock), and the version is
        deleted; their choice stands (:meth:`follow_registry` takes another process's)."""
        if parent != self._current:
            return None
        version = self.registry.publish(candidate.state_dict(), meta, make_current=False)
        with self._registry_lock:
            if parent == self._current and self.registry.compare_and_set(parent, version):
                self._current = version
                kill_point("publish.current")
                return version
        self.registry.discard(version)
        return None

    def _prune(self) -> None:
        """keep_versions: delete old versions (after the hand-over: a failure here costs disk, not the update)."""
        if self.config.keep_versions:
            try:
                self.pruned += self.registry.prune(self.config.keep_versions)
            except OSError as err:
                log.warning("draft %s: old versions not pruned (%s)", self.registry.directory.name, err)

    def _hand_over(self, candidate, version: str, optimizer, records: list) -> None:
        """The proposer takes the new version between two rounds; the next update starts from it."""
        self._latest = (candidate, version)
        self._optimizer_state = copy.deepcopy(optimizer.state_dict())
        self.proposer.swap_model(candidate, version)
        with self._lock:
            self.buffer.after_update(records)
