"""The drafts a stream is served with (arXiv 2310.07177, section 4.3): one per name the router gives, each
with its own proposer, decoder (its own adaptive-k statistics), replay buffer, registry and
learner, all under one output folder::

    drafts/<name>/                            the draft's registry (versions, CURRENT)
    drafts/<name>/suffix-index.safetensors    its suffix index of earlier requests (when its proposer has one)
    buffer/<name>/                            its replay buffer

A draft whose proposer has a suffix index (:mod:`onlinespec.decoding.proposers.suffix`) adds every
served request to it (``suffix_tokens > 0``), whether or not its head learns: it costs no target
call and no training. Its file is kept by :mod:`onlinespec.decoding.proposers.suffix_files`.

A draft is created the first time the router names it, from the starting draft, or, after a
restart, from the last version its registry published. The learners share one update slot: one
update runs at a time, with the whole learner CPU budget, and an update that falls due while
another draft's runs starts as soon as the slot is free (checked after every request).

Operators steer learning through the pool (the server's admin API): pause and resume it (served
requests are still recorded), start an update now, roll a draft back, pin a version, purge a
request's records. ``onlinespec drafts rollback`` from another process takes effect too: the
pool notices the changed CURRENT (:meth:`DraftPool.tick`). Every method may be called from any
thread.

Routing by content (:mod:`onlinespec.routing.lifecycle`, ``DraftPool.content``) decides which
drafts are in memory: it spawns, evicts, reloads and retires them through :meth:`DraftPool.open`
and :meth:`DraftPool.unload`, and scores them with :meth:`DraftPool.alphas`.

Governance (:meth:`DraftPool.governance`): records stored, refused because the client opted out
(``train: false``: no record, no trace, not counted towards the interval), expired by
retention, purged, quarantined, versions pruned.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from onlinespec import memory
from onlinespec.decoding.adaptive import AdaptiveK
from onlinespec.decoding.proposers.base import Proposer
from onlinespec.decoding.proposers.suffix import SuffixIndex
from onlinespec.decoding.proposers.suffix_files import SUFFIX_FILE, SUFFIX_FILES, SuffixFiles, purge_saved_suffix
from onlinespec.decoding.request import Generation
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learnable import learnable
from onlinespec.online.learner import LearnerConfig, OnlineLearner, UpdateReport
from onlinespec.online.registry import DraftRegistry
from onlinespec.online.turns import EngineTurns
from onlinespec.routing.content import STATIC, ContentConfig
from onlinespec.routing.domains import MAX_DRAFTS, SHARED, Router
from onlinespec.routing.lifecycle import ContentRouting, Route, purge_saved_routing

log = logging.getLogger("onlinespec.pool")

RETENTION_SWEEP_SECONDS = 600.0  # how often retention reaches the drafts on disk only (not in memory)


@dataclass
class ServedDraft:
    """A draft as the server serves it: its name, proposer, acceptance statistics, learner and suffix
    index (formerly ``Draft``, which still imports: a name it shared with the drafts/ recipes and the
    request field)."""

    name: str
    proposer: Proposer | None  # None: the target alone
    adaptive: AdaptiveK | None  # its own acceptance statistics (adaptive k)
    learner: OnlineLearner | None
    suffix: SuffixIndex | None = None  # learns from every request it serves (None: no index, or not learning)
    in_flight: int = 0  # content routing: requests it serves or records now (a draft in use is never evicted)
    last_used: int = 0  # content routing: the router's request count when it last served or recorded
    memory: object = None  # its bytes, as the memory budget sees them (onlinespec.memory.DraftMemory)

    @property
    def version(self) -> str | None:
        return self.proposer.version if self.proposer is not None else None


Draft = ServedDraft  # the name before issue 50


def track_draft_memory(draft: ServedDraft) -> memory.DraftMemory:
    """Count ``draft`` (its served model and the copies it drafts with, its learner's newest model
    and optimizer state) against the process's memory budget while it is in memory (the budget
    holds it weakly: it leaves with the draft)."""
    ref = weakref.ref(draft)  # no cycle: the draft leaves memory when the pool lets it go

    def objects() -> list:
        d = ref()
        if d is None:
            return []
        learner, proposer = d.learner, d.proposer
        held = proposer.memory_objects() if hasattr(proposer, "memory_objects") else [getattr(proposer, "model", None)]
        if learner is None:
            return held
        return [*held, learner.publisher.latest[0], learner.updater.trainer.optimizer_state]
    holder = memory.DraftMemory(draft.name, objects)
    memory.budget().register(holder)
    return holder


def learner_row(learner: OnlineLearner) -> dict:
    """A learning draft's row for operators: its versions (with their metadata), the one CURRENT
    names, and its learner's state and updates."""
    registry = learner.registry
    keys = ("parent", "records_seen", "alpha_before", "alpha_after", "published_at", "note")
    return dict(
        versions=[{"version": v, **{k: m.get(k) for k in keys}} for v, m in ((v, registry.meta(v)) for v in registry.versions())],
        current=registry.current(), pinned=learner.pinned, busy=learner.busy, due=learner.due,
        buffer_records=learner.governance()["held"], failures=list(learner.failures), stopped=learner.stopped,
        updates=[{k: v for k, v in vars(r).items() if k != "by_domain"} for r in learner.reports],
    )


def saved_drafts(out_dir: str | Path) -> list[str]:
    """The drafts that a previous run in ``out_dir`` published, oldest first (a restart routes
    their domains to them again)."""
    root = Path(out_dir) / "drafts"
    found = [p for p in root.iterdir() if (p / "CURRENT").exists() or (p / SUFFIX_FILE).exists()] if root.is_dir() else []
    first = lambda p: next((f.stat().st_mtime for f in (p / "v0001", p / SUFFIX_FILE) if f.exists()), 0)  # noqa: E731
    return [p.name for p in sorted(found, key=first)]


def purge_saved_buffers(out_dir: str | Path, request_id: str | None = None, before: float | None = None,
                        drafts: list[str] | None = None) -> dict[str, int]:
    """Purge the replay buffers saved in ``out_dir`` (all of a stopped server's, for ``onlinespec
    data purge``; a running one's drafts that are not in memory, ``drafts``), each read whole:
    how many records went, by draft."""
    root = Path(out_dir) / "buffer"
    folders = sorted(p for p in root.glob("*") if p.is_dir()) if drafts is None else [root / n for n in drafts if (root / n).is_dir()]
    return {p.name: ReplayBuffer(p, max_records=10**9, max_bytes=2**62, budget=None).purge(request_id, before) for p in folders}


def purge_saved(out_dir: str | Path, request_id: str | None = None, before: float | None = None) -> dict:
    """Purge everything a stopped server kept in ``out_dir`` about request ``request_id`` (or
    recorded before ``before``), for ``onlinespec data purge``: every draft's replay buffer (its
    quarantine included) and suffix indices, the content router's far prompts, and every event
    log (the server's, each Ray replica's and learner's, rotated files included)."""
    from onlinespec.storage import delete_stale_rewrites, drop_events

    root = Path(out_dir)
    records = purge_saved_buffers(root, request_id, before)
    logs = sorted(p for pattern in ("events*.jsonl", "*/*/events*.jsonl") for p in root.glob(pattern))
    for log in logs:
        delete_stale_rewrites(log)  # a copy a purge killed mid-way left
    return {"records": records, "suffix_requests": purge_saved_suffix(root / "drafts", request_id, before),
            "routing_prompts": purge_saved_routing(root, request_id, before),
            "event_lines": sum(drop_events(log, request_id, before) for log in logs)}


@dataclass
class PoolConfig:
    """What a :class:`DraftPool` keeps and how (the objects it calls are its other arguments)."""
    learner: LearnerConfig | None = None  # None: every draft serves static (no buffer, no registry)
    buffer_policy: str = "window"
    buffer_records: int = 2000
    buffer_bytes: int = 512 * 2**20
    retention_seconds: float | None = None
    identity: dict = field(default_factory=dict)  # target, draft spec, tokenizer fingerprint: stored with every record and version
    suffix_tokens: int = 0  # the most tokens a draft's suffix index keeps (0: it learns nothing)
    suffix_file: str = SUFFIX_FILE  # the file a draft's suffix index is saved as in its registry folder (each Ray replica keeps its own)
    content: ContentConfig | None = None  # route by content (onlinespec.routing.lifecycle; needs learner)
    max_in_memory: int = MAX_DRAFTS  # content routing: the most drafts in memory (the idlest others wait in their registries)
    keeps_buffers: bool | None = None  # the buffers under out_dir/buffer are this pool's to purge (None: unless learners puts them elsewhere)


class DraftPool:
    def __init__(
        self,
        new_draft: Callable[[], tuple[Proposer, AdaptiveK | None]],
        out_dir: str | Path,
        router: Router | None = None,
        config: PoolConfig | None = None,
        on_event: Callable[[dict], None] | None = None,
        learners: Callable[[str, Proposer], OnlineLearner] | None = None,
        owns: Callable[[str], bool] | None = None,
        turns: EngineTurns | None = None,
        born: dict[str, Callable[[], tuple[Proposer, AdaptiveK | None]]] | None = None,
    ) -> None:
        """``new_draft()`` builds a fresh starting draft and its acceptance statistics; ``config``
        (:class:`PoolConfig`) says what the pool keeps. ``learners(name, proposer, origin)``: where a
        draft's learner lives (default: here, with its buffer under ``out_dir/buffer/<name>``; a Ray
        replica passes a client of its learner actor). ``owns(name)``: whether this pool may purge
        draft ``name``'s files on disk while it is not in memory (default: every draft; a Ray
        learner group, its own). ``turns``: the serving engine's, in which this process's learners
        compute (:mod:`onlinespec.online.turns`). ``born``: drafts that start otherwise than
        ``new_draft()``, by name (the fresh baseline)."""
        config = config or PoolConfig()
        self.out_dir, self.config = Path(out_dir), config
        self.new_draft, self.born, self.identity = new_draft, born or {}, config.identity or {}
        self.suffixes = SuffixFiles(self.out_dir / "drafts", config.suffix_file, config.suffix_tokens, self.identity.get("tokenizer", ""))
        self._learners = learners or self._local_learner
        self._keeps_buffers = learners is None if config.keeps_buffers is None else config.keeps_buffers
        self.owns, self.turns = owns or (lambda name: True), turns
        self.suffix_purged = 0  # indexed requests purged (by request or by age)
        self._swept_at = time.monotonic()  # the last retention sweep of the drafts on disk only
        self.opted_out = 0
        self.on_event = on_event or (lambda event: None)
        self.router = router or Router("single")
        self.drafts: dict[str, ServedDraft] = {}
        self._slot = threading.Semaphore(1)
        self._lock = threading.RLock()
        self.paused = False  # learning paused: requests are still recorded, no update starts
        self.content: ContentRouting | None = None
        if config.content is not None:
            if config.learner is None:
                raise ValueError("content routing needs learning drafts: it scores and trains them on the traffic it routes")
            static = ServedDraft(STATIC, *new_draft(), None)  # the floor: scored on every request, never trained
            self.content = ContentRouting(config.content, self.out_dir, self, static, self._lock, config.max_in_memory, self.on_event,
                                          config.learner.priority)

    def open(self, name: str, start_from: ServedDraft | None = None) -> ServedDraft:
        """The draft called ``name``, in memory: created, or opened from its registry, on first use
        (a new one is a copy of ``start_from``, or the starting draft)."""
        with self._lock:
            if name not in self.drafts:
                self.drafts[name] = self._create(name, start_from)
            return self.drafts[name]

    def route(self, domain: str) -> ServedDraft:
        """The draft that serves a request of ``domain`` (created on first use)."""
        with self._lock:
            return self.open(self.router(domain))

    def _create(self, name: str, start_from: ServedDraft | None = None) -> ServedDraft:
        """A draft called ``name``: from its registry's current version if it has one, else a copy
        of ``start_from``'s model (its registry's first version says so) or the starting draft."""
        proposer, adaptive = self.born.get(name, self.new_draft)()
        origin = None
        if start_from is not None and not (self.out_dir / "drafts" / name / "CURRENT").exists():
            model = start_from.proposer.model
            proposer.swap_model(learnable(model).copy(model), proposer.version)
            proposer.take_swap()
            origin = {"note": f"spawned from draft {start_from.name} {start_from.version}",
                      "spawned_from": {"draft": start_from.name, "version": start_from.version}}
        learner = None
        swappable = proposer is not None and proposer.swappable
        index = proposer.suffix_index if proposer is not None else None
        if self.config.learner is not None and (swappable or index is None):  # a suffix proposer learns through its index alone
            if not swappable:
                raise ValueError(f"online learning needs a learned draft (a draft LM, a head, a hybrid) or a suffix index, "
                                 f"not {proposer.name if proposer is not None else 'none'!r}")
            learner = self._learners(name, proposer, origin)
            data = learner.governance()
            self.on_event({"event": "draft", "draft": name, "draft_version": proposer.version, "buffer_records": data["held"],
                           "quarantined": data["quarantined"]})
        draft = ServedDraft(name, proposer, adaptive, learner)
        draft.memory = track_draft_memory(draft)  # issue 46: counted against the memory budget while in memory
        if index is not None and self.config.suffix_tokens > 0:
            self.suffixes.open(name, index)
            draft.suffix = index
            self.on_event({"event": "suffix_index", "draft": name, **index.stats()})
        return draft

    def _local_learner(self, name: str, proposer: Proposer, origin: dict | None = None) -> OnlineLearner:
        """A learner in this process, with its durable buffer and its registry under the out-dir."""
        buffer = ReplayBuffer(self.out_dir / "buffer" / name, self.config.buffer_policy, max_records=self.config.buffer_records,
                              max_bytes=self.config.buffer_bytes, retention_seconds=self.config.retention_seconds,
                              identity=self.identity.get("tokenizer", ""))
        registry = DraftRegistry(self.out_dir / "drafts" / name)
        return OnlineLearner(proposer, buffer, registry, self.config.learner, identity=self.identity,
                             on_event=lambda event: self.on_event({**event, "draft": name}), slot=self._slot, origin=origin,
                             turns=self.turns)

    def store(self, name: str, records: list, new_tokens: int) -> bool:
        """Store a request's records (made where it was served) with draft ``name``'s learner,
        durably, and start the update due longest if the slot is free: a learner actor's side of
        :meth:`observe`."""
        learner = self.learned(name).learner
        stored = learner.observe_records(records, new_tokens, start=False)
        with self._lock:
            self._start_next()
        return stored

    def observe(self, draft: ServedDraft, generation: Generation, domain: str, request_id: str, train: bool = True,
                route: Route | None = None, tenant: str = "") -> bool:
        """Record a served request with its draft's learner (durable when this returns; whether
        every record was stored); then, if the slot is free, start the update that has waited
        longest for it (first due, first served: none waits for ever). ``route``: the request was
        routed by content (``draft`` is its home): its records are scored for every draft, and
        its alpha feeds its cluster's drift detector. ``tenant``: whose suffix-index lookups may
        find this request ("": everyone's)."""
        if draft.learner is None and draft.suffix is None:
            return False
        if not train:
            self.opted_out += 1
            return False
        if draft.suffix is not None:
            draft.suffix.add(generation.prompt_ids + generation.token_ids, request_id, tenant=tenant)
        if draft.learner is None:
            return False
        untraced = not generation.trace and bool(generation.token_ids)  # left unrecorded: OnlineLearner.records_next
        # routed by content, records are judged by cluster (the gate holds out each cluster's newest) and scored for every draft
        group = domain if route is None else f"c{route.cluster}"
        records = [] if untraced else draft.learner.records(generation, group, request_id)
        stored = draft.learner.observe_records(records, len(generation.token_ids), start=False) and not untraced
        if route is not None:
            self.content.observed(route, records, generation.stats.acceptance_rate, generation.stats.accepted + generation.stats.rejected)
        with self._lock:
            self._start_next()
        return stored

    def open_saved(self) -> list[str]:
        """Open every draft a previous run in the out-dir published that the router serves (at
        start-up: a registry of another model is refused then, not at its domain's first
        request); their names."""
        if self.config.learner is None and self.config.suffix_tokens <= 0:
            return []
        if self.content is not None:  # the drafts in memory when it stopped; the others wait in their registries
            self.content.reopen(saved_drafts(self.out_dir),
                                check=lambda name: DraftRegistry(self.out_dir / "drafts" / name).check_identity(self.identity))
            return list(self.drafts)
        serves = {SHARED} if self.router.policy == "single" else {*self.router.drafts, SHARED}
        with self._lock:
            for name in saved_drafts(self.out_dir):
                if name in serves and name not in self.drafts:
                    self.drafts[name] = self._create(name)
            return list(self.drafts)

    def tick(self) -> None:
        """Housekeeping, every second or so (the core's housekeeping thread): expire records
        past retention, serve the version another process made CURRENT, save suffix indices, and
        content routing's (:meth:`ContentRouting.tick`)."""
        self.suffixes.expire(self.config.retention_seconds)
        self.suffixes.save()
        if self.content is not None:
            self.content.tick()
        if self.config.retention_seconds is not None and time.monotonic() - self._swept_at >= RETENTION_SWEEP_SECONDS:
            self._swept_at = time.monotonic()  # retention reaches the drafts on disk only too
            try:
                self._purge_on_disk(None, time.time() - self.config.retention_seconds)
            except Exception:
                log.exception("the retention sweep of the drafts on disk failed; it runs again in %s s", RETENTION_SWEEP_SECONDS)
        for learner in self.learners:
            try:
                learner.expire()
                learner.follow_registry()
            except Exception:  # one draft's trouble never stops the others' housekeeping
                log.exception("housekeeping of draft %s failed; serving goes on", learner.registry.directory.name)

    def close(self) -> None:
        """At shutdown: content routing's scorer stops and its state is saved; so is every suffix index."""
        if self.content is not None:
            self.content.close()
        self.suffixes.save(force=True)

    def purge(self, request_id: str | None = None, before: float | None = None) -> int:
        """Delete a request's records (or those recorded before ``before``) from every buffer:
        the drafts' in memory, and those on disk only (see :meth:`_purge_on_disk`)."""
        removed = self._purge_on_disk(request_id, before)
        for learner in self.learners:
            removed += learner.purge(request_id, before)
        self.suffix_purged += self.suffixes.purge(request_id, before)
        return removed

    def _purge_on_disk(self, request_id: str | None, before: float | None) -> int:
        """Purge the buffers and suffix indices of every draft on disk that is not in memory
        (content routing evicted or retired it, or an earlier run made it); under the pool's lock,
        so none is loaded meanwhile. Each buffer is read whole to do it: a purge, or a retention
        sweep every few minutes. The router's far prompts of the request go too."""
        with self._lock:
            on_disk = {p.name for folder in ("buffer", "drafts") for p in (self.out_dir / folder).glob("*") if p.is_dir()}
            names = sorted(n for n in on_disk - set(self.drafts) if self.owns(n))
            removed = sum(purge_saved_buffers(self.out_dir, request_id, before, drafts=names).values()) if self._keeps_buffers else 0
            self.suffix_purged += purge_saved_suffix(self.out_dir / "drafts", request_id, before, drafts=names,
                                                     files=SUFFIX_FILES if self._keeps_buffers else self.suffixes.file)
        if self.content is not None:
            self.content.purge(request_id, before)
        return removed

    def governance(self) -> dict:
        """What happened to the training data: see the module docstring."""
        counts = dict.fromkeys(("stored", "held", "evicted", "expired", "purged", "quarantined", "write_failures", "versions_pruned"), 0)
        for learner in self.learners:
            for key, n in learner.governance().items():
                if key in counts:
                    counts[key] += n
        suffix = [d.suffix.stats() for d in list(self.drafts.values()) if d.suffix is not None]
        return {"records_stored": counts["stored"], "records_held": counts["held"], "refused_opt_out": self.opted_out,
                "suffix_requests_held": sum(s["requests"] for s in suffix), "suffix_tokens_held": sum(s["tokens"] for s in suffix),
                "write_failures": counts["write_failures"], "evicted": counts["evicted"], "expired": counts["expired"],
                "purged": counts["purged"], "quarantined": counts["quarantined"], "versions_pruned": counts["versions_pruned"],
                "retention_seconds": self.config.retention_seconds}

    def _start_next(self) -> bool:
        waiting = [learner for learner in self.learners if learner.due]
        return not self.paused and bool(waiting) and min(waiting, key=lambda learner: learner.due_since).maybe_update()

    # ---- what content routing asks of the pool (onlinespec.routing.lifecycle.Pool, with open) ----

    def unload(self, name: str) -> None:
        """Take draft ``name`` out of memory (content routing evicts or retires it): its learner
        stops; its registry, buffer and suffix index stay on disk."""
        draft = self.drafts.pop(name)
        if draft.learner is not None:
            draft.learner.stop(timeout=60)
        self.suffixes.close(name)

    def alphas(self, drafts: dict[str, ServedDraft], records: list) -> dict[str, float]:
        """Each draft's alpha on a recorded request's records (content routing's scorer thread)."""
        distill = self.config.learner.distill
        with torch.inference_mode():
            return {n: learnable(d.proposer.model).metrics(d.proposer.model, records, distill)["alpha"] for n, d in drafts.items()}

    # ---- operators ------------------------------------------------------------------------

    def learned(self, name: str) -> ServedDraft:
        """The learning draft called ``name``; a KeyError names the ones there are."""
        draft = self.drafts.get(name)
        if draft is None or draft.learner is None:
            known = [n for n, d in self.drafts.items() if d.learner is not None]
            raise KeyError(f"no learning draft {name!r}; drafts: {known or 'none yet (a draft is made by its first request)'}")
        return draft

    def pause(self, paused: bool = True) -> None:
        """Pause (or resume) learning: updates due wait; resuming starts the longest-waiting one."""
        with self._lock:
            self.paused = paused
            if not paused:
                self._start_next()

    def update_now(self, name: str) -> bool:
        """Start ``name``'s update now, whatever its count; False if an update is running."""
        learner = self.learned(name).learner
        with self._lock:
            if len(learner.buffer) < 2:
                raise ValueError(f"draft {name!r} has {len(learner.buffer)} records: an update needs at least 2")
            return learner.update_now()

    def rollback(self, name: str) -> str:
        """Serve the current version's parent; return it."""
        learner = self.learned(name).learner
        current = learner.registry.current()
        parent = learner.registry.meta(current).get("parent") if current else None
        if not parent:
            raise ValueError(f"draft {name!r} serves {current}, which has no parent to roll back to")
        learner.serve_version(parent)
        return parent

    def pin(self, name: str, version: str | None) -> None:
        """Serve ``version`` and publish no update (learning goes on); ``None`` unpins."""
        learner = self.learned(name).learner
        if version is not None and version != learner.registry.current():
            learner.serve_version(version)
        learner.pinned = version is not None

    @property
    def learners(self) -> list[OnlineLearner]:
        return [d.learner for d in list(self.drafts.values()) if d.learner is not None]

    @property
    def busy(self) -> bool:
        return any(learner.busy for learner in self.learners)

    def wait(self, drain: bool = False) -> None:
        """Block until the updates in flight end (shutdown; serving never waits); with ``drain``,
        then run the updates still due, one after another (the end of a stream)."""
        while True:
            for learner in self.learners:
                learner.wait()
            if not (drain and self._start_next()):
                return

    def reports(self) -> list[tuple[str, UpdateReport]]:
        """Every update of every draft, as (draft name, report), in the order they ended."""
        tagged = [(name, r) for name, d in list(self.drafts.items()) if d.learner for r in d.learner.reports]
        return sorted(tagged, key=lambda pair: pair[1].ended_at)
