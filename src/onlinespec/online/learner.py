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
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.drafts.feature_head import FeatureHead
from onlinespec.drafts.train import ChainConfig, chain_task, head_metrics
from onlinespec.decoding.speculative import Generation
from onlinespec.distill.step import DistillConfig, distill_step, evaluate
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.recorder import SOURCES, records_from_generation
from onlinespec.online.registry import DraftRegistry

UNITS = ("requests", "records", "tokens")


@dataclass
class LearnerConfig:
    update_interval: int = 25  # I
    interval_unit: str = "requests"  # requests | records | tokens (generated tokens)
    position_policy: str = "verified"  # which verified positions become training rows (recorder; the paper: rejected)
    distill: DistillConfig = field(default_factory=DistillConfig)
    steps_per_update: int = 40
    batch_size: int = 32  # examples per step: chain starts for a feature head, records for a draft LM
    lr: float = 3e-4
    gate_fraction: float = 0.2  # the newest share of the buffer's records, held out to judge a candidate
    gate_margin: float = 0.0  # publish if candidate alpha >= serving alpha - margin
    gate_by: str = "domain"  # domain: hold out the newest share of EACH domain's records, and publish only
    # if the candidate loses on none of them (a draft tuned to the newest traffic must not serve the rest
    # worse); newest: the newest share of all records, judged pooled
    source: str = "teacher"  # sampling source: teacher | student | mixed (recorder)
    threads: int = 1  # torch threads of the learner thread (serving keeps the rest)
    priority: str = "low"  # low: the OS runs the learner only on CPU time serving leaves; normal
    cpu_share: float = 1.0  # the most wall time the learner computes (it sleeps the rest)
    chain_depth: int = 4  # feature heads: draft steps unrolled in training

    def __post_init__(self) -> None:
        if self.interval_unit not in UNITS:
            raise ValueError(f"unknown interval unit {self.interval_unit!r}: use one of {UNITS}")
        if self.source not in SOURCES:
            raise ValueError(f"unknown sampling source {self.source!r}: use one of {SOURCES}")
        if self.gate_by not in ("domain", "newest"):
            raise ValueError(f"gate_by must be 'domain' or 'newest', got {self.gate_by!r}")
        if self.priority not in ("low", "normal"):
            raise ValueError(f"priority must be 'low' or 'normal', got {self.priority!r}")
        if not 0.0 < self.cpu_share <= 1.0:
            raise ValueError(f"cpu_share must lie in (0, 1], got {self.cpu_share}")
        if self.update_interval < 1 or self.steps_per_update < 1 or self.threads < 1:
            raise ValueError("update_interval, steps_per_update and threads must be >= 1")


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
    by_domain: dict = field(default_factory=dict)  # gate_by="domain": {domain: [alpha before, alpha after]}
    ended_at: float = 0.0  # wall-clock time
    outcome: str = ""  # published | refused (by the gate) | pinned (passed the gate, not published: a version is pinned)


class OnlineLearner:
    def __init__(
        self,
        proposer: DraftModelProposer,
        buffer: ReplayBuffer,
        registry: DraftRegistry,
        config: LearnerConfig | None = None,
        background: bool = True,
        on_event: Callable[[dict], None] | None = None,
        slot: threading.Semaphore | None = None,
    ) -> None:
        """``on_event`` is called from the learner thread when an update starts and when it ends.
        ``slot``: shared by the learners of several drafts, so that one update runs at a time
        (each has the CPU budget to itself); a due update waits for it, it is never dropped."""
        self.proposer, self.buffer, self.registry = proposer, buffer, registry
        self.on_event, self.slot = on_event, slot
        self.config = config or LearnerConfig()
        self.background = background
        self.reports: list[UpdateReport] = []
        self._count = 0
        self._records_seen = 0
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the buffer between serving and learner threads
        self._cancel = threading.Event()
        self.steps_done = 0  # optimizer steps taken by all updates (cancelled ones included)
        self.failures: list[str] = []  # updates that raised (the serving path never sees their errors)
        self.pinned = False  # an operator pinned the serving version: updates still run, none publishes
        self.due_since: float | None = None  # when the update now due fell due (time.monotonic)
        current = registry.current()
        if current is None:
            registry.publish(proposer.model.state_dict(), {"parent": None, "records_seen": 0, "note": "starting draft"})
            proposer.version = registry.current()
        else:  # a restart (or a rollback): serve the registry's current version, not the starting draft
            proposer.swap_model(self._load_version(current), current)
            proposer.take_swap()  # take it now: nothing is being served yet
        # the newest published draft: the next update starts from it even if the proposer has not
        # taken it yet (it swaps between rounds), so no update's work is ever dropped
        self._latest = (proposer.model, proposer.version)
        self._optimizer_state: dict | None = None  # the optimizer of the newest published draft

    def _load_version(self, version: str):
        """A private copy of the serving draft holding ``version``'s weights."""
        model = _private_copy(self.proposer.model)
        model.load_state_dict(self.registry.load(version), strict=False)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        return model.eval()

    def observe(
        self, generation: Generation, domain: str = "default", request_id: str = "", train: bool = True, start: bool = True,
    ) -> None:
        """Record a served request (skipped when ``train`` is False) and, with ``start``, start an
        update when due (a pool of drafts starts it itself, in the order the updates fell due)."""
        config = self.config
        records = records_from_generation(generation, config.position_policy, config.source, domain, request_id) if train else []
        with self._lock:
            for record in records:
                self.buffer.add(record)
            self._records_seen += len(records)
            unit = self.config.interval_unit
            self._count += {"requests": 1, "records": len(records), "tokens": len(generation.token_ids)}[unit]
        if self.due and self.due_since is None:
            self.due_since = time.monotonic()
        if start:
            self.maybe_update()

    @property
    def due(self) -> bool:
        """I units have been served since the last update started."""
        return self._count >= self.config.update_interval

    def maybe_update(self) -> bool:
        """Start the update that is due, if this learner and the shared slot are free (serving thread)."""
        return self.due and self.update_now()

    def update_now(self) -> bool:
        """Start an update now, whatever the count (also an operator's request); the count
        starts again. False if this learner or the shared slot is busy."""
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
        self.stop()
        model = self._load_version(version)
        self.registry.set_current(version)
        self.proposer.swap_model(model, version)
        self._latest, self._optimizer_state = (model, version), None

    # ---- the update (learner thread) ------------------------------------------------------------

    def _objective(self, train: list):
        """(training examples, step(candidate, optimizer, batch), evaluate(model, records)) for this
        draft: records for a draft LM; chain start positions for a feature head."""
        config = self.config.distill
        if isinstance(self.proposer.model, FeatureHead):
            task = chain_task(train, self.config.position_policy, ChainConfig(depth=self.config.chain_depth))
            return (
                task.starts.tolist(),
                lambda model, optimizer, batch: task.step(model, optimizer, batch, config),
                lambda model, records: head_metrics(model, records, config),
            )
        return (
            train,
            lambda model, optimizer, batch: distill_step(model, optimizer, batch, config),
            lambda model, records: evaluate(model, records, config),
        )

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
        """The learner thread's CPU budget: its torch threads and, at low priority, nice 19."""
        torch.set_num_threads(self.config.threads)
        if self.config.priority == "low" and self.background and hasattr(os, "setpriority"):
            try:  # on Linux a thread is a task: this renices the learner thread only
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass

    def _update(self) -> None:
        serving_threads = torch.get_num_threads()
        try:
            self._budget()
            self._run_update()
        except Exception as err:  # an update that fails publishes nothing and never stops serving
            self.failures.append(f"{type(err).__name__}: {err}")
            if self.on_event:
                self.on_event({"event": "update_failed", "error": self.failures[-1], "parent": self._latest[1], "time": time.time()})
        finally:
            if self.slot is not None:
                self.slot.release()
            if not self.background:  # the update ran on the serving thread: give it its threads back
                torch.set_num_threads(serving_threads)

    def _run_update(self) -> None:
        start = time.perf_counter()
        with self._lock:
            records = self.buffer.records()
            records_seen = self._records_seen
        if len(records) < 2:
            return
        if self.on_event:
            self.on_event({"event": "update_start", "records": len(records), "parent": self._latest[1], "time": time.time()})
        train, groups = self._held_out(records)
        held_out = [r for rs in groups.values() for r in rs]
        serving, parent = self._latest
        # private: the serving draft is never touched (a head shares only its frozen target tensors)
        candidate = _private_copy(serving)
        examples, step, evaluate_fn = self._objective(train)
        if not examples:
            return
        before = evaluate_fn(serving, held_out)
        before_by = {d: evaluate_fn(serving, rs)["alpha"] for d, rs in groups.items()} if len(groups) > 1 else {}
        optimizer = torch.optim.AdamW([p for p in candidate.parameters() if p.is_floating_point()], lr=self.config.lr)
        if self._optimizer_state is not None:  # carry Adam's moments on: a fresh optimizer's first steps jump by ~lr everywhere
            optimizer.load_state_dict(self._optimizer_state)
            for group in optimizer.param_groups:
                group["lr"] = self.config.lr
        candidate.requires_grad_(True)
        generator = torch.Generator().manual_seed(len(self.reports))
        share = self.config.cpu_share
        for _ in range(self.config.steps_per_update):
            pick = torch.randint(len(examples), (min(self.config.batch_size, len(examples)),), generator=generator).tolist()
            if self._cancel.is_set():
                return
            tick = time.perf_counter()
            step(candidate, optimizer, [examples[i] for i in pick])
            self.steps_done += 1
            if share < 1.0:
                time.sleep((time.perf_counter() - tick) * (1.0 - share) / share)
        candidate.requires_grad_(False).eval()
        after = evaluate_fn(candidate, held_out)
        by_domain = {d: [before_by[d], evaluate_fn(candidate, rs)["alpha"]] for d, rs in groups.items()} if before_by else {}
        margin = self.config.gate_margin
        version = None
        passed = after["alpha"] >= before["alpha"] - margin and all(a >= b - margin for b, a in by_domain.values())
        if self._cancel.is_set():  # shutdown or a rollback while it ran: never publish
            return
        if passed and not self.pinned:
            meta = {
                "parent": parent,
                "records_seen": records_seen,
                "loss_before": before["loss"],
                "loss_after": after["loss"],
                "alpha_before": before["alpha"],
                "alpha_after": after["alpha"],
                "alpha_by_domain": by_domain,
                "config": asdict(self.config),
            }
            version = self.registry.publish(candidate.state_dict(), meta)
            self._latest = (candidate, version)
            self._optimizer_state = copy.deepcopy(optimizer.state_dict())
            self.proposer.swap_model(candidate, version)
            with self._lock:
                self.buffer.after_update(records)
        outcome = "published" if version else "pinned" if passed else "refused"
        report = UpdateReport(version, parent, records_seen, before["loss"], after["loss"], before["alpha"], after["alpha"],
                              time.perf_counter() - start, len(examples), by_domain, time.time(), outcome)
        self.reports.append(report)
        if self.on_event:
            self.on_event({"event": "update", **asdict(report), "time": time.time()})



def _private_copy(model):
    """A copy to train: a head shares only its frozen target tensors, a draft LM is copied whole."""
    return model.clone() if isinstance(model, FeatureHead) else copy.deepcopy(model)
