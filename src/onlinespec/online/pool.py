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

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError

from onlinespec.decoding.adaptive import AdaptiveK
from onlinespec.decoding.proposers.base import Proposer
from onlinespec.decoding.proposers.suffix import IdentityMismatch, SuffixIndex
from onlinespec.decoding.request import Generation
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learner import LearnerConfig, OnlineLearner, UpdateReport
from onlinespec.online.registry import DraftRegistry
from onlinespec.routing import SHARED, Router

log = logging.getLogger("onlinespec.pool")

SAVE_SECONDS = 10.0  # a changed suffix index is saved at most this often (and on purge and shutdown)
SUFFIX_FILE = "suffix-index.safetensors"


@dataclass
class Draft:
    name: str
    proposer: Proposer | None  # None: the target alone
    adaptive: AdaptiveK | None  # its own acceptance statistics (adaptive k)
    learner: OnlineLearner | None
    suffix: SuffixIndex | None = None  # learns from every request it serves (None: no index, or not learning)
    suffix_path: Path | None = None

    @property
    def version(self) -> str | None:
        return getattr(self.proposer, "version", None)


def saved_drafts(out_dir: str | Path) -> list[str]:
    """The drafts that a previous run in ``out_dir`` published, oldest first (a restart routes
    their domains to them again)."""
    root = Path(out_dir) / "drafts"
    found = [p for p in root.iterdir() if (p / "CURRENT").exists() or (p / SUFFIX_FILE).exists()] if root.is_dir() else []
    first = lambda p: next((f.stat().st_mtime for f in (p / "v0001", p / SUFFIX_FILE) if f.exists()), 0)  # noqa: E731
    return [p.name for p in sorted(found, key=first)]


def purge_saved_suffix(out_dir: str | Path, request_id: str | None = None, before: float | None = None) -> int:
    """Purge the suffix indices a stopped server left in ``out_dir`` (``onlinespec data purge``):
    the requests leave every saved index, and set-aside (unreadable) copies are deleted; how many
    indexed requests went."""
    removed = 0
    for path in sorted((Path(out_dir) / "drafts").glob(f"*/{SUFFIX_FILE}")):
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
    for folder in (Path(out_dir) / "drafts").glob("*"):
        _delete_set_aside(folder)
    return removed


def _delete_set_aside(folder: Path, before: float | None = None) -> None:
    """Delete the unreadable suffix indices set aside in a draft's folder (they may hold
    requests): all of them, or those last written before ``before``."""
    for stale in (folder / "quarantine").glob(f"{SUFFIX_FILE}.*"):
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
    ) -> None:
        """``new_draft()`` builds a fresh starting draft and its acceptance statistics;
        ``learner=None`` serves every draft static (no buffer, no registry). ``identity``
        (target, draft spec, tokenizer fingerprint) is stored with every record and version.
        ``suffix_tokens``: the most tokens a draft's suffix index keeps (0: it learns nothing)."""
        self.out_dir = Path(out_dir)
        self.new_draft, self.learner_config = new_draft, learner
        self.buffer_policy, self.buffer_records, self.buffer_bytes = buffer_policy, buffer_records, buffer_bytes
        self.retention_seconds, self.identity = retention_seconds, identity or {}
        self.suffix_tokens = suffix_tokens
        self.suffix_purged = 0  # indexed requests purged (by request or by age)
        self._saved_at = 0.0
        self.opted_out = 0
        self.on_event = on_event or (lambda event: None)
        self.router = router or Router("single")
        self.drafts: dict[str, Draft] = {}
        self._slot = threading.Semaphore(1)
        self._lock = threading.RLock()
        self.paused = False  # learning paused: requests are still recorded, no update starts

    def route(self, domain: str) -> Draft:
        """The draft that serves a request of ``domain`` (created on first use)."""
        with self._lock:
            name = self.router(domain)
            if name not in self.drafts:
                self.drafts[name] = self._create(name)
            return self.drafts[name]

    def _create(self, name: str) -> Draft:
        proposer, adaptive = self.new_draft()
        learner = None
        model_free = getattr(proposer, "suffix_index", None) is not None and not hasattr(proposer, "swap_model")
        if self.learner_config is not None and not model_free:  # a suffix proposer learns through its index alone
            if not hasattr(proposer, "swap_model"):
                raise ValueError(f"online learning needs a learned draft (a draft LM, a head, a hybrid) or a suffix index, "
                                 f"not {getattr(proposer, 'name', 'none')!r}")
            buffer = ReplayBuffer(self.out_dir / "buffer" / name, self.buffer_policy, max_records=self.buffer_records,
                                  max_bytes=self.buffer_bytes, retention_seconds=self.retention_seconds,
                                  identity=self.identity.get("tokenizer", ""))
            registry = DraftRegistry(self.out_dir / "drafts" / name)
            learner = OnlineLearner(proposer, buffer, registry, self.learner_config, identity=self.identity,
                                    on_event=lambda event: self.on_event({**event, "draft": name}), slot=self._slot)
            self.on_event({"event": "draft", "draft": name, "draft_version": proposer.version, "buffer_records": len(buffer),
                           "quarantined": buffer.counts["quarantined"] + len(registry.quarantined)})
        draft = Draft(name, proposer, adaptive, learner)
        self._open_suffix(draft)
        return draft

    def _open_suffix(self, draft: Draft) -> None:
        """Give the draft its suffix index's saved contents (an unreadable file is moved to the
        registry's quarantine/ and the index starts empty)."""
        index = getattr(draft.proposer, "suffix_index", None)
        if index is None or self.suffix_tokens <= 0:
            return
        index.max_tokens, index.identity = self.suffix_tokens, self.identity.get("tokenizer", "")
        draft.suffix, draft.suffix_path = index, self.out_dir / "drafts" / draft.name / SUFFIX_FILE
        draft.suffix_path.parent.mkdir(parents=True, exist_ok=True)
        if draft.suffix_path.exists():
            try:
                index.load(draft.suffix_path)
            except IdentityMismatch:
                raise
            except (ValueError, KeyError, SafetensorError) as err:  # a bad file; an I/O error of the moment is raised
                quarantine = draft.suffix_path.parent / "quarantine"
                quarantine.mkdir(exist_ok=True)
                shutil.move(str(draft.suffix_path), quarantine / f"{SUFFIX_FILE}.{int(time.time())}")
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

    def observe(self, draft: Draft, generation: Generation, domain: str, request_id: str, train: bool = True) -> bool:
        """Record a served request with its draft's learner (durable when this returns; whether
        every record was stored); then, if the slot is free, start the update that has waited
        longest for it (first due, first served: none waits for ever)."""
        if draft.learner is None and draft.suffix is None:
            return False
        if not train:
            self.opted_out += 1
            return False
        if draft.suffix is not None:
            draft.suffix.add(generation.prompt_ids + generation.token_ids, request_id)
        if draft.learner is None:
            return False
        stored = draft.learner.observe(generation, domain, request_id, train, start=False)
        with self._lock:
            self._start_next()
        return stored

    def open_saved(self) -> list[str]:
        """Open every draft a previous run in the out-dir published that the router serves (at
        start-up: a registry of another model is refused then, not at its domain's first
        request); their names."""
        if self.learner_config is None and self.suffix_tokens <= 0:
            return []
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
        for learner in self.learners:
            try:
                with learner._lock:
                    learner.buffer.expire()
                learner.follow_registry()
            except Exception:  # one draft's trouble never stops the others' housekeeping
                log.exception("housekeeping of draft %s failed; serving goes on", learner.registry.directory.name)

    def purge(self, request_id: str | None = None, before: float | None = None) -> int:
        """Delete a request's records (or those recorded before ``before``) from every buffer."""
        removed = 0
        for learner in self.learners:
            with learner._lock:
                removed += learner.buffer.purge(request_id, before)
        for draft in list(self.drafts.values()):
            if draft.suffix is None:
                continue
            gone = draft.suffix.purge(request_id, before)
            if gone:
                draft.suffix.save(draft.suffix_path)  # durable now: the purge is acknowledged
                self.suffix_purged += gone
            _delete_set_aside(draft.suffix_path.parent)
        return removed

    def governance(self) -> dict:
        """What happened to the training data: see the module docstring."""
        counts = dict.fromkeys(("stored", "evicted", "expired", "purged", "quarantined"), 0)
        held = write_failures = pruned = 0
        for learner in self.learners:
            for key, n in learner.buffer.counts.items():
                counts[key] += n
            counts["quarantined"] += len(learner.registry.quarantined)
            held += len(learner.buffer)
            write_failures += learner.write_failures
            pruned += len(learner.pruned)
        suffix = [d.suffix.stats() for d in list(self.drafts.values()) if d.suffix is not None]
        return {"records_stored": counts["stored"], "records_held": held, "refused_opt_out": self.opted_out,
                "suffix_requests_held": sum(s["requests"] for s in suffix), "suffix_tokens_held": sum(s["tokens"] for s in suffix),
                "write_failures": write_failures, "evicted": counts["evicted"], "expired": counts["expired"],
                "purged": counts["purged"], "quarantined": counts["quarantined"], "versions_pruned": pruned,
                "retention_seconds": self.retention_seconds}

    def _start_next(self) -> bool:
        waiting = [learner for learner in self.learners if learner.due]
        return not self.paused and bool(waiting) and min(waiting, key=lambda learner: learner.due_since).maybe_update()

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
