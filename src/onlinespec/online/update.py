"""One update of the online learner (arXiv 2310.07177, section 4.2), on the learner thread: take the
replay buffer's records, train a candidate from the newest published draft, gate it, publish it and
hand it to the proposer, and report what happened (:class:`UpdateReport`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from onlinespec.online.budget import UpdateBudget
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.config import LearnerConfig
from onlinespec.online.floor import AcceptanceFloor
from onlinespec.online.gate import CandidateGate, NextGate, paired_error
from onlinespec.online.learnable import LearnableDraft
from onlinespec.online.publisher import Publisher
from onlinespec.online.trainer import CandidateTrainer


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
    # | floor (refused, and the serving draft fell below the starting one: that one serves again, onlinespec.online.floor)
    engine_seconds: float = 0.0  # the compute time it took (its wall time less its waits for the engine's turns)
    steps: int = 0  # optimizer steps it took (by its phase: onlinespec.online.schedule)
    cold: bool = False  # the draft was born from the target (LearnableDraft.cold): the learning controller judges it by alpha
    gate_metric: str = "alpha"  # the figure the gate decided by (LearnerConfig.gate_metric; alpha for a draft LM)
    replayed_before: float | None = None  # gate_metric replayed: the serving draft's replayed figure on the held-out records
    replayed_after: float | None = None  # the candidate's
    static_replayed: float | None = None  # the floor (onlinespec.online.floor): the starting draft's replayed figure there
    floor_breached: bool = False  # the serving draft accepted less than the starting one, with 95% confidence
    gate_error: float | None = None  # the paired standard error of the candidate's gain in the gate's figure (None: no per-position figures)
    decidable: bool | None = None  # the gain exceeded DECIDABLE paired standard errors: the gate could tell, not a coin toss
    phase: str = ""  # the draft's phase: cold, shifted or steady (onlinespec.online.schedule)
    lr: float = 0.0  # the learning rate it trained at


DECIDABLE = 1.96  # two-sided 95%: a candidate whose gain exceeds this many paired standard errors is decidable


class Updater:
    """Runs updates (:meth:`run`) from what :class:`~onlinespec.online.learner.OnlineLearner` gives it."""

    def __init__(self, config: LearnerConfig, learnable: LearnableDraft, buffer: ReplayBuffer, lock: threading.Lock,
                 publisher: Publisher, budget: UpdateBudget, cancel: threading.Event, on_event: Callable[[dict], None],
                 pinned: Callable[[], bool], identity: dict) -> None:
        """``lock`` guards ``buffer`` between the serving and learner threads; ``pinned()``: an
        operator pinned the serving version (updates still run, none publishes)."""
        self.config, self.learnable, self.buffer, self.lock = config, learnable, buffer, lock
        self.publisher, self.budget, self.cancel, self.on_event = publisher, budget, cancel, on_event
        self.pinned, self.identity = pinned, identity
        self.trainer = CandidateTrainer(config, learnable, budget, cancel)
        self.gate = CandidateGate(config, learnable, budget.pause)
        self.next = NextGate()  # gate="next": the candidate waiting for the requests served after it
        self.floor = AcceptanceFloor(learnable, publisher, lambda model, records: self.gate.measure(model, records, replay=True))
        self.reports: list[UpdateReport] = []

    def train(self, serving, records: list):
        """(candidate, optimizer, examples, plan) trained from ``serving`` on ``records``, or None."""
        return self.trainer.train(serving, records, seed=len(self.reports))

    def run(self, records: list, records_seen: int) -> None:
        """One update on ``records`` (a snapshot of the buffer, which had seen ``records_seen``)."""
        start = time.perf_counter()
        if len(records) < 2:
            return
        serving, parent = self.publisher.latest
        self.on_event({"event": "update_start", "records": len(records), "parent": parent, "time": time.time()})
        if self.config.gate == "next":  # judge the pending candidate on the records served since it trained
            trained = self.next.take(records, parent, self.config.gate_by)
            if trained is None:
                return self.next.train(self.train, self.publisher.latest, records)
            *trained, groups = trained
        else:
            train, groups = self.gate.held_out(records)
            trained = self.train(serving, train)
        if trained is None:  # no example to train on, or cancelled
            return None
        candidate, optimizer, examples, plan = trained
        cold = self.learnable.cold(serving)
        figure = self.gate.figure(cold)
        before, after, by_domain, passed = self.gate.judge(serving, candidate, groups, figure)
        floor = self.floor.judge(parent, [r for rs in groups.values() for r in rs], before, figure, self.config.gate_margin) \
            if self.config.floor else None
        breached = floor is not None and floor["below"]
        if breached:  # the candidate must beat the starting draft too, or the starting draft serves
            passed = passed and after[figure] >= floor["floor"]
        if self.cancel.is_set():  # shutdown or a rollback while it ran: never publish
            return None
        version, outcome = self._publish(candidate, optimizer, records, passed, {
            "parent": parent, "records_seen": records_seen, "loss_before": before["loss"], "loss_after": after["loss"],
            "alpha_before": before["alpha"], "alpha_after": after["alpha"], "alpha_by_domain": by_domain,
            "gate_metric": figure, "replayed_before": before.get("replayed"), "replayed_after": after.get("replayed"),
            "config": asdict(self.config), "identity": self.identity,
        })
        if breached and outcome == "refused":
            outcome = self._fall_back(parent, floor)
        if self.buffer.policy == "priority":
            self.score()
        seconds = time.perf_counter() - start
        error = paired_error(before, after) or None
        report = UpdateReport(version, parent, records_seen, before["loss"], after["loss"], before["alpha"], after["alpha"],
                              seconds, examples, by_domain, time.time(), outcome, seconds - self.budget.waited, plan.steps, cold,
                              figure, before.get("replayed"), after.get("replayed"), floor and floor["static"], breached, error,
                              None if error is None else abs(after[figure] - before[figure]) > DECIDABLE * error, plan.phase, plan.lr)
        self.reports.append(report)
        self.on_event({"event": "update", **asdict(report), "time": time.time()})
        if self.config.gate == "next":
            self.next.train(self.train, self.publisher.latest, records)  # the next candidate, from what serves now
        return None

    def _publish(self, candidate, optimizer, records: list, passed: bool, meta: dict) -> tuple[str | None, str]:
        """(the version published or None, the outcome): a candidate that passed is published
        unless a version is pinned, then served; the buffer hears that an update used ``records``."""
        if not passed or self.pinned():
            return None, "pinned" if passed else "refused"
        version = self.publisher.publish(candidate, meta, meta["parent"])
        if version is None:
            return None, "superseded"
        self.publisher.hand_over(candidate, version)
        self.trainer.carry(optimizer)
        with self.lock:
            self.buffer.after_update(records)
        self.publisher.prune()
        return version, "published"

    def _fall_back(self, parent: str, floor: dict) -> str:
        """The floor is breached and the candidate does not beat the starting draft: serve that
        one (unless an operator pinned a version); the outcome."""
        if self.pinned():
            return "refused"
        version = self.floor.serve_static()
        self.trainer.forget()  # the next candidates train from the starting draft, with a fresh optimizer
        self.on_event({"event": "floor", "draft": self.publisher.registry.directory.name, "was": parent, "serves": version,
                       "serving_replayed": round(floor["serving"], 4), "static_replayed": round(floor["static"], 4),
                       "paired_error": round(floor["error"], 4), "time": time.time()})
        return "floor"

    def score(self) -> None:
        """Priority policy: the serving draft's loss on every buffered record (hardest kept)."""
        with self.lock:
            records = self.buffer.records()
        model, distill = self.publisher.latest[0], self.config.distill
        scored = [(r, self.learnable.metrics(model, [r], distill)["loss"]) for r in records]
        with self.lock:
            self.buffer.set_priorities(scored)
