# Over 500 lines: drafts, learners and the content-routing lifecycle together; moving the lifecycle to a routing/ package is issue 29.
"""The drafts a stream is served with (arXiv 2310.07177, section 4.3): one per name the router gives, each
with its own proposer, decoder (its own adaptive-k statistics), replay buffer, registry and
learner, all under one output folder::

    drafts/<name>/                            the draft's registry (versions, CURRENT)
    drafts/<name>/suffix-index.safetensors    its suffix index of earlier requests (when its proposer has one)
    buffer/<name>/                            its replay buffer

A draft whose proposer has a suffix index (:mod:`onlinespec.decoding.proposers.suffix`) adds every
served request to it (``suffix_tokens > 0``), whether or not its head learns: it costs no target
call and no training. The index is saved atomically every ``SAVE_SECONDS`` (when it changed), on a purge and
at shutdown, and loaded again on restart.

A draft is created the first time the router names it, from the starting draft, or, after a
restart, from the last version its registry published. The learners share one update slot: one
update runs at a time, with the whole learner CPU budget, and an update that falls due while
another draft's runs starts as soon as the slot is free (checked after every request).

Operators steer learning through the pool (the server's admin API): pause and resume it (served
requests are still recorded), start an update now, roll a draft back, pin a version, purge a
request's records. ``onlinespec drafts rollback`` from another process takes effect too: the
pool notices the changed CURRENT (:meth:`DraftPool.tick`). Every method may be called from any
thread.

Governance (:meth:`DraftPool.governance`): records stored, refused because the client opted out
(``train: false``: no record, no trace, not counted towards the interval), expired by
retention, purged, quarantined, versions pruned.
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from onlinespec.routing.content import STATIC, ContentConfig, ContentRouter
from onlinespec.cpu import lower_priority, name_thread
from onlinespec.decoding.adaptive import AdaptiveK
from onlinespec.decoding.proposers.base import Proposer
from onlinespec.decoding.proposers.suffix import IdentityMismatch, SuffixIndex
from onlinespec.decoding.request import Generation
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learnable import learnable
from onlinespec.online.learner import LearnerConfig, OnlineLearner, UpdateReport
from onlinespec.online.registry import DraftRegistry
from onlinespec.storage import atomic_write
from onlinespec.online.turns import EngineTurns
from onlinespec.routing.domains import MAX_DRAFTS, SHARED, Router, draft_name

log = logging.getLogger("onlinespec.pool")

SAVE_SECONDS = 10.0  # a changed suffix index is saved at most this often (and on purge and shutdown)
SUFFIX_FILE = "suffix-index.safetensors"  # a Ray replica's: suffix-index.<replica>.safetensors (replica_suffix_file)
SUFFIX_FILES = "suffix-index*.safetensors"


def replica_suffix_file(replica: str) -> str:
    return f"suffix-index.{replica}.safetensors"
ROUTING_FILE = "routing.json"  # content routing's clusters, scores and the drafts' lifecycle
RETENTION_SWEEP_SECONDS = 600.0  # how often retention reaches the drafts on disk only (not in memory)
SCORE_BACKLOG = 32  # requests waiting for the content scorer; beyond it the oldest goes unscored (about 2.5 MB of records).
# Scored in order, so a full backlog is how late each score arrives: about the scores' memory (ContentConfig.score_memory)


@dataclass
class Draft:
    name: str
    proposer: Proposer | None  # None: the target alone
    adaptive: AdaptiveK | None  # its own acceptance statistics (adaptive k)
    learner: OnlineLearner | None
    suffix: SuffixIndex | None = None  # learns from every request it serves (None: no index, or not learning)
    suffix_path: Path | None = None
    in_flight: int = 0  # content routing: requests it serves or records now (a draft in use is never evicted)
    last_used: int = 0  # content routing: the router's request count when it last served or recorded

    @property
    def version(self) -> str | None:
        return getattr(self.proposer, "version", None)


@dataclass
class Route:
    """Content routing's answer for one request."""

    serve: Draft  # whose proposer drafts for it (the cluster's best-scoring draft, or the static floor)
    home: Draft  # whose buffer and learner record it (its cluster's draft)
    cluster: int  # the cluster it was served as
    member_of: int  # the cluster its prompt joined: what its scores and alpha update
    request: int = 0  # its number in the router's count (scores are kept by it)


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
    return {p.name: ReplayBuffer(p, max_records=10**9, max_bytes=2**62).purge(request_id, before) for p in folders}


def purge_saved_suffix(out_dir: str | Path, request_id: str | None = None, before: float | None = None,
                       drafts: list[str] | None = None, files: str = SUFFIX_FILES) -> int:
    """Purge the suffix indices saved in ``out_dir`` (all of a stopped server's, for ``onlinespec
    data purge``; a running one's drafts that are not in memory, ``drafts``): the requests leave
    every saved index (``files``: which of a draft's, by pattern; a Ray replica purges its own),
    and set-aside (unreadable) copies are deleted; how many indexed requests went."""
    removed = 0
    root = Path(out_dir) / "drafts"
    folders = sorted(root.glob("*")) if drafts is None else [root / name for name in drafts]
    for path in sorted(f for folder in folders for f in folder.glob(files)):
        index = SuffixIndex(max_tokens=2**62)
        try:
            index.load(path)
        except (ValueError, KeyError, SafetensorError):  # unreadable: nothing to keep of it
            path.unlink()
            continue
        gone = index.purge(request_id, before)
        if gone:
            index.save(path)
            removed += gone
    for folder in folders:
        _delete_set_aside(folder)
    return removed


def purge_saved_routing(out_dir: str | Path, request_id: str | None = None, before: float | None = None) -> int:
    """Purge a stopped server's content-routing state (``routing.json``): the far prompts of
    request ``request_id`` (or recorded before ``before``) leave it; how many went."""
    path = Path(out_dir) / ROUTING_FILE
    if not path.exists():
        return 0
    state = json.loads(path.read_text())
    router = ContentRouter.from_state(state["router"])
    removed = router.purge(request_id, before)
    if removed:
        atomic_write(path, json.dumps({**state, "router": router.state()}))
    return removed


def purge_saved(out_dir: str | Path, request_id: str | None = None, before: float | None = None) -> dict:
    """Purge everything a stopped server kept in ``out_dir`` about request ``request_id`` (or
    recorded before ``before``), for ``onlinespec data purge``: every draft's replay buffer (its
    quarantine included) and suffix indices, the content router's far prompts, and every event
    log (the server's, each Ray replica's and learner's, rotated files included)."""
    from onlinespec.storage import drop_events

    root = Path(out_dir)
    records = purge_saved_buffers(root, request_id, before)
    logs = sorted(p for pattern in ("events*.jsonl", "*/*/events*.jsonl") for p in root.glob(pattern))
    return {"records": records, "suffix_requests": purge_saved_suffix(root, request_id, before),
            "routing_prompts": purge_saved_routing(root, request_id, before),
            "event_lines": sum(drop_events(log, request_id, before) for log in logs)}


def _delete_set_aside(folder: Path, before: float | None = None) -> None:
    """Delete the unreadable suffix indices set aside in a draft's folder (they may hold
    requests): all of them, or those last written before ``before``."""
    for stale in (folder / "quarantine").glob(f"{SUFFIX_FILES}.*"):
        if before is None or stale.stat().st_mtime < before:
            stale.unlink(missing_ok=True)


class DraftPool:
    def __init__(
        self,
        new_draft: Callable[[], tuple[Proposer, AdaptiveK | None]],
        out_dir: str | Path,
        router: Router | None = None,
        learner: LearnerConfig | None = None,
        buffer_policy: str = "window",
        buffer_records: int = 2000,
        on_event: Callable[[dict], None] | None = None,
        buffer_bytes: int = 512 * 2**20,
        retention_seconds: float | None = None,
        identity: dict | None = None,
        suffix_tokens: int = 0,
        content: ContentConfig | None = None,
        max_in_memory: int = MAX_DRAFTS,
        learners: Callable[[str, Proposer], OnlineLearner] | None = None,
        suffix_file: str = SUFFIX_FILE,
        owns: Callable[[str], bool] | None = None,
        keeps_buffers: bool | None = None,
        turns: EngineTurns | None = None,
    ) -> None:
        """``new_draft()`` builds a fresh starting draft and its acceptance statistics;
        ``learner=None`` serves every draft static (no buffer, no registry). ``identity``
        (target, draft spec, tokenizer fingerprint) is stored with every record and version.
        ``suffix_tokens``: the most tokens a draft's suffix index keeps (0: it learns nothing).
        ``content``: route by content (:mod:`onlinespec.routing.content`; needs ``learner``), with at
        most ``max_in_memory`` drafts in memory (the idlest others wait in their registries).
        ``learners(name, proposer, origin)``: where a draft's learner lives (default: here, with its buffer
        under ``out_dir/buffer/<name>``; a Ray replica passes a client of its learner actor).
        ``suffix_file``: the file a draft's suffix index is saved as in its registry folder (each
        Ray replica keeps its own). ``owns(name)``: whether this pool may purge draft ``name``'s
        files on disk while it is not in memory (default: every draft; a Ray learner group, its own).
        ``keeps_buffers``: whether the buffers under ``out_dir/buffer`` are this pool's to purge
        (default: unless ``learners`` puts them elsewhere; a Ray replica's never are). ``turns``: the
        serving engine's, in which this process's learners compute (:mod:`onlinespec.online.turns`)."""
        self.out_dir = Path(out_dir)
        self.new_draft, self.learner_config = new_draft, learner
        self.buffer_policy, self.buffer_records, self.buffer_bytes = buffer_policy, buffer_records, buffer_bytes
        self.retention_seconds, self.identity = retention_seconds, identity or {}
        self.suffix_tokens, self.suffix_file = suffix_tokens, suffix_file
        self._learners = learners or self._local_learner
        self._keeps_buffers = learners is None if keeps_buffers is None else keeps_buffers
        self.owns = owns or (lambda name: True)
        self.turns = turns
        self.suffix_purged = 0  # indexed requests purged (by request or by age)
        self._swept_at = time.monotonic()  # the last retention sweep of the drafts on disk only
        self._saved_at = 0.0
        self.opted_out = 0
        self.on_event = on_event or (lambda event: None)
        self.router = router or Router("single")
        self.drafts: dict[str, Draft] = {}
        self._slot = threading.Semaphore(1)
        self._lock = threading.RLock()
        self.paused = False  # learning paused: requests are still recorded, no update starts
        self.content: ContentRouter | None = None
        if content is not None:
            self._start_content(content, max_in_memory)

    def open(self, name: str) -> Draft:
        """The draft called ``name`` (created, or opened from its registry, on first use)."""
        with self._lock:
            if name not in self.drafts:
                self.drafts[name] = self._create(name)
            return self.drafts[name]

    def route(self, domain: str) -> Draft:
        """The draft that serves a request of ``domain`` (created on first use)."""
        with self._lock:
            return self.open(self.router(domain))

    def _create(self, name: str, start_from: Draft | None = None) -> Draft:
        """A draft called ``name``: from its registry's current version if it has one, else a copy
        of ``start_from``'s model (its registry's first version says so) or the starting draft."""
        proposer, adaptive = self.new_draft()
        origin = None
        if start_from is not None and not (self.out_dir / "drafts" / name / "CURRENT").exists():
            model = start_from.proposer.model
            proposer.swap_model(learnable(model).copy(model), proposer.version)
            proposer.take_swap()
            origin = {"note": f"spawned from draft {start_from.name} {start_from.version}",
                      "spawned_from": {"draft": start_from.name, "version": start_from.version}}
        learner = None
        model_free = getattr(proposer, "suffix_index", None) is not None and not hasattr(proposer, "swap_model")
        if self.learner_config is not None and not model_free:  # a suffix proposer learns through its index alone
            if not hasattr(proposer, "swap_model"):
                raise ValueError(f"online learning needs a learned draft (a draft LM, a head, a hybrid) or a suffix index, "
                                 f"not {getattr(proposer, 'name', 'none')!r}")
            learner = self._learners(name, proposer, origin)
            data = learner.governance()
            self.on_event({"event": "draft", "draft": name, "draft_version": proposer.version, "buffer_records": data["held"],
                           "quarantined": data["quarantined"]})
        draft = Draft(name, proposer, adaptive, learner)
        self._open_suffix(draft)
        return draft

    def _local_learner(self, name: str, proposer: Proposer, origin: dict | None = None) -> OnlineLearner:
        """A learner in this process, with its durable buffer and its registry under the out-dir."""
        buffer = ReplayBuffer(self.out_dir / "buffer" / name, self.buffer_policy, max_records=self.buffer_records,
                              max_bytes=self.buffer_bytes, retention_seconds=self.retention_seconds,
                              identity=self.identity.get("tokenizer", ""))
        registry = DraftRegistry(self.out_dir / "drafts" / name)
        return OnlineLearner(proposer, buffer, registry, self.learner_config, identity=self.identity,
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

    def _open_suffix(self, draft: Draft) -> None:
        """Give the draft its suffix index's saved contents (an unreadable file is moved to the
        registry's quarantine/ and the index starts empty)."""
        index = getattr(draft.proposer, "suffix_index", None)
        if index is None or self.suffix_tokens <= 0:
            return
        index.max_tokens, index.identity = self.suffix_tokens, self.identity.get("tokenizer", "")
        draft.suffix, draft.suffix_path = index, self.out_dir / "drafts" / draft.name / self.suffix_file
        draft.suffix_path.parent.mkdir(parents=True, exist_ok=True)
        if draft.suffix_path.exists():
            try:
                index.load(draft.suffix_path)
            except IdentityMismatch:
                raise
            except (ValueError, KeyError, SafetensorError) as err:  # a bad file; an I/O error of the moment is raised
                quarantine = draft.suffix_path.parent / "quarantine"
                quarantine.mkdir(exist_ok=True)
                shutil.move(str(draft.suffix_path), quarantine / f"{self.suffix_file}.{int(time.time())}")
                log.warning("draft %s: its suffix index could not be read (%s): moved to %s, starting empty", draft.name, err, quarantine)
        self.on_event({"event": "suffix_index", "draft": draft.name, **index.stats()})

    def save_suffix(self, force: bool = False) -> None:
        """Save every changed suffix index (at most every SAVE_SECONDS unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._saved_at < SAVE_SECONDS:
            return
        self._saved_at = now
        for draft in list(self.drafts.values()):
            if draft.suffix is not None and (draft.suffix.dirty or force and not draft.suffix_path.exists()):
                try:
                    draft.suffix.save(draft.suffix_path)
                except OSError as err:  # a full disk: serving goes on, the index stays in memory
                    log.error("draft %s: its suffix index could not be saved: %s", draft.name, err)

    def observe(self, draft: Draft, generation: Generation, domain: str, request_id: str, train: bool = True,
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
        if route is None:
            stored = draft.learner.observe(generation, domain, request_id, train, start=False)
        else:  # records are judged by cluster (the gate holds out each cluster's newest) and scored for every draft
            records = draft.learner.records(generation, f"c{route.cluster}", request_id)
            stored = draft.learner.observe_records(records, len(generation.token_ids), start=False)
            self._observed(route, records, generation.stats.acceptance_rate, generation.stats.accepted + generation.stats.rejected)
        with self._lock:
            self._start_next()
        return stored

    def open_saved(self) -> list[str]:
        """Open every draft a previous run in the out-dir published that the router serves (at
        start-up: a registry of another model is refused then, not at its domain's first
        request); their names."""
        if self.learner_config is None and self.suffix_tokens <= 0:
            return []
        if self.content is not None:  # the drafts in memory when it stopped; the others wait in their registries
            with self._lock:
                state = json.loads((self.out_dir / ROUTING_FILE).read_text()) if (self.out_dir / ROUTING_FILE).exists() else {}
                for name in saved_drafts(self.out_dir):
                    if name in self.retired:
                        continue
                    if name in state.get("in_memory", []) and len(self.drafts) < self.max_in_memory:
                        self.drafts[name] = self._create(name)
                    else:
                        DraftRegistry(self.out_dir / "drafts" / name).check_identity(self.identity)
                        self.evicted.add(name)
                return list(self.drafts)
        serves = {SHARED} if self.router.policy == "single" else {*self.router.drafts, SHARED}
        with self._lock:
            for name in saved_drafts(self.out_dir):
                if name in serves and name not in self.drafts:
                    self.drafts[name] = self._create(name)
            return list(self.drafts)

    def tick(self) -> None:
        """Housekeeping, every second or so (the core's housekeeping thread): expire records
        past retention, serve the version another process made CURRENT, save suffix indices."""
        for draft in list(self.drafts.values()):
            if draft.suffix is None:
                continue
            try:
                draft.suffix.expire(self.retention_seconds)
                if self.retention_seconds is not None:  # set-aside copies go with retention too
                    _delete_set_aside(draft.suffix_path.parent, time.time() - self.retention_seconds)
            except Exception:  # one draft's trouble never stops the others' housekeeping
                log.exception("housekeeping of draft %s's suffix index failed; serving goes on", draft.name)
        self.save_suffix()
        if self.content is not None:
            try:
                with self._lock:  # drafts that had to stay while busy leave once idle: those loaded past
                    # --max-drafts while the others were busy, and those a merge retired while they served
                    while len(self.drafts) > self.max_in_memory and self._evict_idlest():
                        pass
                    for name in [n for n, d in self.drafts.items() if n in self.retired and self._idle(d)]:
                        self._evict(name, why="retired")
                self.save_routing()
            except Exception:  # never stops the housekeeping
                log.exception("content routing's housekeeping failed; serving goes on")
        if self.retention_seconds is not None and time.monotonic() - self._swept_at >= RETENTION_SWEEP_SECONDS:
            self._swept_at = time.monotonic()  # retention reaches the drafts on disk only too
            try:
                self._purge_on_disk(None, time.time() - self.retention_seconds)
            except Exception:
                log.exception("the retention sweep of the drafts on disk failed; it runs again in %s s", RETENTION_SWEEP_SECONDS)
        for learner in self.learners:
            try:
                learner.expire()
                learner.follow_registry()
            except Exception:  # one draft's trouble never stops the others' housekeeping
                log.exception("housekeeping of draft %s failed; serving goes on", learner.registry.directory.name)

    def purge(self, request_id: str | None = None, before: float | None = None) -> int:
        """Delete a request's records (or those recorded before ``before``) from every buffer:
        the drafts' in memory, and those on disk only (see :meth:`_purge_on_disk`)."""
        removed = self._purge_on_disk(request_id, before)
        for learner in self.learners:
            removed += learner.purge(request_id, before)
        for draft in list(self.drafts.values()):
            if draft.suffix is None:
                continue
            gone = draft.suffix.purge(request_id, before)
            if gone:
                draft.suffix.save(draft.suffix_path)  # durable now: the purge is acknowledged
                self.suffix_purged += gone
            _delete_set_aside(draft.suffix_path.parent)
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
            self.suffix_purged += purge_saved_suffix(self.out_dir, request_id, before, drafts=names,
                                                     files=SUFFIX_FILES if self._keeps_buffers else self.suffix_file)
            if self.content is not None and self.content.purge(request_id, before):
                self._routing_dirty = True
        if self.content is not None:
            self.save_routing(force=True)
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
                "retention_seconds": self.retention_seconds}

    def _start_next(self) -> bool:
        waiting = [learner for learner in self.learners if learner.due]
        return not self.paused and bool(waiting) and min(waiting, key=lambda learner: learner.due_since).maybe_update()

    # ---- content routing (onlinespec.routing.content) -----------------------------------------------------

    def _start_content(self, config: ContentConfig, max_in_memory: int) -> None:
        if self.learner_config is None:
            raise ValueError("content routing needs learning drafts: it scores and trains them on the traffic it routes")
        if max_in_memory < 1:
            raise ValueError(f"max_in_memory must be >= 1, got {max_in_memory}")
        self.max_in_memory = max_in_memory
        self.evicted: set[str] = set()
        self.retired: dict[str, str] = {}  # draft -> why (merged into another)
        self.lifecycle = dict.fromkeys(("spawned", "evicted", "reloaded", "retired"), 0)
        self.detections: dict[str, int] = {}
        saved = self.out_dir / ROUTING_FILE
        if saved.exists():
            state = json.loads(saved.read_text())
            self.content = ContentRouter.from_state(state["router"], config)
            self.evicted, self.retired = set(state.get("evicted", [])), dict(state.get("retired", {}))
            self.lifecycle.update(state.get("lifecycle", {}))
            self.detections.update(state.get("detections", {}))
        else:
            self.content = ContentRouter(config)
        proposer, adaptive = self.new_draft()
        self.static = Draft(STATIC, proposer, adaptive, None)  # the floor: scored on every request, never trained
        self._routing_dirty, self._routing_saved_at = False, 0.0
        self._last_home: str | None = None
        self._scores: queue.Queue = queue.Queue(SCORE_BACKLOG)
        self.scores_dropped, self._dropped_reported, self._dropped_at = 0, 0, float("-inf")
        self._scorer = threading.Thread(target=self._score_loop, name="onlinespec-scorer", daemon=True)
        self._scorer.start()

    def provisional(self, load: bool = True) -> Draft | None:
        """The draft a request starts with until its prompt is prefilled and routed (its first
        round drafts nothing from a head: no target feature yet): the last routed request's.
        ``load=False``: only one already in memory (None if it would have to be loaded: model
        work, for the engine thread)."""
        with self._lock:
            name = self._last_home or next((k.draft for k in self.content.clusters.values() if k.live and k.draft), None)
            name = name if name and name not in self.retired else f"c{self.content.next_id}"
            return self._loaded(name) if load else self.drafts.get(name)

    def route_content(self, embedding: torch.Tensor, hint: str | None = None, request_id: str | None = None) -> Route:
        """Route a prefilled request (engine thread): its cluster, the draft that records it, and
        the draft that serves it; spawns, reloads and evicts drafts as the router decides."""
        with self._lock:
            content = self.content
            assignment = content.assign(embedding, hint, request_id)
            self._apply_events()
            cluster = content.cluster(assignment.cluster)
            if cluster.draft is None or cluster.draft in self.retired:
                self._give_draft(cluster)
            home = self._loaded(cluster.draft)
            available = {n for n, d in self.drafts.items() if d.learner is not None} | {STATIC}
            name = content.choose(cluster.id, available) or home.name
            self._apply_events()
            serve = self.static if name == STATIC else self.drafts.get(name, home)
            for draft in {id(home): home, id(serve): serve}.values():
                draft.in_flight += 1
                draft.last_used = content.requests
            self._last_home, self._routing_dirty = home.name, True
            return Route(serve, home, cluster.id, content._alias(assignment.member_of), assignment.request)

    def release(self, route: Route) -> None:
        """A routed request ended (answered, failed or cancelled)."""
        with self._lock:
            for draft in {id(route.home): route.home, id(route.serve): route.serve}.values():
                draft.in_flight = max(0, draft.in_flight - 1)

    def _loaded(self, name: str) -> Draft:
        """The draft called ``name``, in memory (reloaded from its registry if it was evicted)."""
        draft = self.drafts.get(name)
        if draft is None:
            self._make_room(keep=name)
            draft = self.drafts[name] = self._create(name)
            if name in self.evicted:
                self.evicted.discard(name)
                self._lifecycle("reloaded", name)
        return draft

    def _give_draft(self, cluster) -> None:
        """A live cluster without a draft of its own gets one, spawned from the draft that scores
        best on its requests (the starting draft when nothing scored it yet)."""
        parent = cluster.parent or self.content.best(cluster, learned_only=True)
        parent = parent if parent in self.drafts or parent in self.evicted else None  # static: the starting draft
        name = f"c{cluster.id}"
        label = cluster.label()
        if label:
            name = f"c{cluster.id}-{draft_name(label)}"[:63]
        if name not in self.drafts:  # (the first cluster's draft may exist already: the first request's provisional one)
            start = self._loaded(parent) if parent else None
            self._make_room(keep=name)
            self.drafts[name] = self._create(name, start_from=start)
        cluster.draft = name
        self.content.inherit(name, parent)
        self._lifecycle("spawned", name, cluster=cluster.id, parent=parent or "starting draft")

    def _make_room(self, keep: str) -> None:
        """Evict the least recently used idle drafts until one more fits in memory."""
        while len(self.drafts) >= self.max_in_memory:
            idle = [d for n, d in self.drafts.items() if n != keep and self._idle(d)]
            if not idle:  # serving or updating: housekeeping evicts when one is idle again (tick)
                log.info("%d drafts are in use or updating: one more is loaded beyond --max-drafts %d for now",
                         len(self.drafts), self.max_in_memory)
                return
            self._evict(min(idle, key=lambda d: d.last_used).name)

    @staticmethod
    def _idle(draft: Draft) -> bool:
        """Neither serving nor recording a request, nor updating: it may leave memory."""
        return draft.in_flight == 0 and not (draft.learner and draft.learner.busy)

    def _evict_idlest(self) -> bool:
        idle = [d for d in self.drafts.values() if self._idle(d) and d.name != self._last_home]
        if idle:
            self._evict(min(idle, key=lambda d: d.last_used).name)
        return bool(idle)

    def _evict(self, name: str, why: str = "evicted") -> None:
        """Take a draft out of memory: its registry and buffer stay on disk; it is reloaded
        from them when its cluster comes back."""
        draft = self.drafts.pop(name)
        if draft.learner is not None:
            draft.learner.stop(timeout=60)
        if draft.suffix is not None:
            try:
                draft.suffix.save(draft.suffix_path)
            except OSError as err:
                log.error("draft %s: its suffix index could not be saved on eviction: %s", name, err)
        if why == "evicted":
            self.evicted.add(name)
            self._lifecycle("evicted", name)

    def _lifecycle(self, action: str, name: str, **more) -> None:
        self.lifecycle[action] += 1
        self._routing_dirty = True
        self.on_event({"event": "draft_" + action, "draft": name, "in_memory": sorted(self.drafts), **more})

    def _apply_events(self) -> None:
        """Carry out what the router decided, and log it."""
        content = self.content
        events, content.events = content.events, []
        for event in events:
            kind = event["event"]
            if kind == "drift":
                key = event["kind"]
                self.detections[key] = self.detections.get(key, 0) + 1
                target = event.get("hurry") or (event.get("draft") if key == "alpha" else None)
                if target in self.drafts and self.drafts[target].learner is not None:
                    self.drafts[target].learner.hurry()
                if key == "alpha" and event.get("shared"):  # a draft of its own, from the best scoring one
                    cluster = content.cluster(event["cluster"])
                    if cluster is not None:
                        cluster.draft = None
            elif kind == "cluster" and event.get("why") != "first":
                self.detections["new_cluster"] = self.detections.get("new_cluster", 0) + 1
            elif kind == "merge" and event.get("retired"):
                retired = event["retired"]
                self.retired[retired] = f"merged into {event['draft']} (cluster {event['merged']} joined {event['cluster']})"
                content.forget(retired)
                if retired in self.drafts and self._idle(self.drafts[retired]):  # else housekeeping does, once it is
                    self._evict(retired, why="retired")
                self.evicted.discard(retired)
                self.lifecycle["retired"] += 1
            self._routing_dirty = True
            self.on_event({**event, "routed": content.requests})

    def _observed(self, route: Route, records: list, alpha: float, judged: int = 1) -> None:
        """After a routed request's records are stored (recorder thread): its alpha feeds its
        cluster's detector; its records wait for the scorer."""
        with self._lock:
            if judged:  # a request with nothing judged says nothing about alpha
                self.content.served(route.member_of, alpha)
            self._apply_events()
        if records:
            self._score_later((route.member_of, route.request, records))

    def _score_later(self, job) -> None:
        """Queue a request for the scorer. A full backlog (the scorer, at the lowest priority,
        fell behind serving) drops its oldest request unscored: the newest say more about the
        traffic, and memory stays bounded. Drops are counted, and reported as one event a minute."""
        while True:
            try:
                self._scores.put_nowait(job)
                break
            except queue.Full:
                try:
                    self._scores.get_nowait()
                    self.scores_dropped += 1
                except queue.Empty:
                    pass
        if job is not None and self.scores_dropped > self._dropped_reported and time.monotonic() - self._dropped_at >= 60:
            dropped, self._dropped_reported, self._dropped_at = self.scores_dropped - self._dropped_reported, self.scores_dropped, time.monotonic()
            log.warning("the content scorer is behind: %d requests went unscored (the backlog holds %d)", dropped, SCORE_BACKLOG)
            with self._lock:
                self.on_event({"event": "scorer_behind", "dropped": dropped, "dropped_total": self.scores_dropped, "backlog": SCORE_BACKLOG})

    def _score_loop(self) -> None:
        """Full-information scoring, in the background (one torch thread, the lowest priority):
        every draft in memory and the static one, on each recorded request's verified positions."""
        torch.set_num_threads(1)
        name_thread("onlinespec-score")
        lower_priority(self.learner_config.priority)
        distill = self.learner_config.distill
        while (job := self._scores.get()) is not None:
            cluster, request, records = job
            try:
                with self._lock:
                    models = {STATIC: self.static.proposer.model, **{n: d.proposer.model for n, d in self.drafts.items()
                                                                    if d.learner is not None}}
                with torch.inference_mode():
                    alphas = {n: learnable(m).metrics(m, records, distill)["alpha"] for n, m in models.items()}
                with self._lock:
                    self.content.score(cluster, alphas, request)
                    self._routing_dirty = True
            except Exception:  # scoring is advice: serving and learning go on without it
                log.exception("scoring a request for content routing failed")

    def save_routing(self, force: bool = False) -> None:
        """Save the router's state (atomically; at most every SAVE_SECONDS unless ``force``)."""
        if self.content is None or not (self._routing_dirty or force):
            return
        now = time.monotonic()
        if not force and now - self._routing_saved_at < SAVE_SECONDS:
            return
        with self._lock:
            state = {"router": self.content.state(), "evicted": sorted(self.evicted), "retired": self.retired,
                     "lifecycle": self.lifecycle, "detections": self.detections, "in_memory": sorted(self.drafts)}
            self._routing_dirty, self._routing_saved_at = False, now
        try:
            atomic_write(self.out_dir / ROUTING_FILE, json.dumps(state))
        except OSError as err:
            log.error("the content router's state could not be saved: %s", err)

    def stop_scoring(self) -> None:
        if self.content is not None:
            self._score_later(None)
            self._scorer.join(60)

    def routing(self) -> dict:
        """Content routing's state for operators (clusters, lifecycle, detections)."""
        if self.content is None:
            return {}
        with self._lock:
            return {"clusters": self.content.summary(), "in_memory": sorted(self.drafts), "evicted": sorted(self.evicted),
                    "retired": dict(self.retired), "lifecycle": dict(self.lifecycle), "detections": dict(self.detections),
                    "requests": self.content.requests, "scores_dropped": self.scores_dropped}

    # ---- operators ------------------------------------------------------------------------

    def learned(self, name: str) -> Draft:
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
