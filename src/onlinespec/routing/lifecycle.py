"""Content routing carried out (docs/routing.md): the content router's decisions (:mod:`.content`)
applied to the drafts a pool holds, over their lifecycle.

- A cluster without a draft of its own gets one, spawned from the draft that scores best on its
  requests (the starting draft when nothing scored it yet).
- At most ``max_in_memory`` drafts stay in memory: the least recently used idle one is evicted (its
  registry, buffer and suffix index stay on disk) and reloaded when its cluster comes back. A draft
  that serves, records or updates is never evicted; housekeeping (:meth:`ContentRouting.tick`)
  evicts it once it is idle.
- A merge retires the worse-scoring draft of the two clusters.
- Every request is served from the start by a *provisional* draft (the last routed request's),
  until its prompt is prefilled and routed.
- A background scorer (one torch thread, the learners' priority) scores every learning draft in
  memory, and the static one, on each recorded request: the router's full information.

Clusters, scores and the drafts' lifecycle are saved in ``routing.json`` in the out-dir, so a
restart routes as before. The drafts themselves, their learners and their files are the pool's
(:class:`onlinespec.online.pool.DraftPool`, a floor above): this module reaches them only through
:class:`Pool`, under the pool's lock.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from onlinespec.cpu import lower_priority, name_thread
from onlinespec.routing.content import STATIC, Cluster, ContentConfig, ContentRouter
from onlinespec.routing.domains import draft_name
from onlinespec.storage import atomic_write, set_aside

log = logging.getLogger("onlinespec.pool")  # the name operators' log filters know it by

ROUTING_FILE = "routing.json"  # content routing's clusters, scores and the drafts' lifecycle
QUARANTINE = "quarantine"  # beside it: unreadable routing states set aside (they may hold far prompts)
SAVE_SECONDS = 10.0  # a changed state is saved at most this often (and on purge and shutdown)
SCORE_BACKLOG = 32  # requests waiting for the content scorer; beyond it the oldest goes unscored (about 2.5 MB of records).
# Scored in order, so a full backlog is how late each score arrives: about the scores' memory (ContentConfig.score_memory)


class Learner(Protocol):
    busy: bool  # updating now: its draft stays in memory until it is done

    def hurry(self) -> None: ...  # start the next update now (drift)


class PoolDraft(Protocol):
    """A draft as content routing sees it (:class:`onlinespec.online.pool.ServedDraft`)."""

    name: str
    learner: Learner | None  # None: it does not learn, so it is neither scored nor chosen
    in_flight: int  # requests it serves or records now (a draft in use is never evicted)
    last_used: int  # the router's request count when it last served or recorded


class Pool(Protocol):
    """What content routing needs of the pool whose drafts it steers."""

    drafts: dict[str, PoolDraft]  # in memory, by name

    def open(self, name: str, start_from: PoolDraft | None = None) -> PoolDraft:
        """Draft ``name`` in memory: from its registry, else a new copy of ``start_from`` (None: the starting draft)."""

    def unload(self, name: str) -> None:
        """Take draft ``name`` out of ``drafts``; its files stay on disk."""

    def alphas(self, drafts: dict[str, PoolDraft], records: list) -> dict[str, float]:
        """Each draft's alpha on a recorded request's records (the scorer's thread)."""


@dataclass
class Route:
    """Content routing's answer for one request."""

    serve: PoolDraft  # whose proposer drafts for it (the cluster's best-scoring draft, or the static floor)
    home: PoolDraft  # whose buffer and learner record it (its cluster's draft)
    cluster: int  # the cluster it was served as
    member_of: int  # the cluster its prompt joined: what its scores and alpha update
    request: int = 0  # its number in the router's count (scores are kept by it)


class ContentRouting:
    """Every method may be called from any thread."""

    def __init__(self, config: ContentConfig, out_dir: str | Path, pool: Pool, static: PoolDraft, lock: threading.RLock,
                 max_in_memory: int, on_event: Callable[[dict], None], priority: str) -> None:
        """``static``: the starting draft kept static, the floor scored on every request and never
        trained; ``lock``: the pool's (routing decides which of its drafts are in memory);
        ``priority``: the scorer thread's (the learners')."""
        if max_in_memory < 1:
            raise ValueError(f"max_in_memory must be >= 1, got {max_in_memory}")
        self.pool, self.static, self.lock, self.max_in_memory, self.on_event = pool, static, lock, max_in_memory, on_event
        self.path = Path(out_dir) / ROUTING_FILE
        self.evicted: set[str] = set()
        self._said: dict | None = None  # an event of start-up, told once the pool is made (reopen)
        self.retired: dict[str, str] = {}  # draft -> why (merged into another)
        self.lifecycle = dict.fromkeys(("spawned", "evicted", "reloaded", "retired"), 0)
        self.detections: dict[str, int] = {}
        self.router = self._read_state(config)
        self._dirty, self._saved_at = False, 0.0
        self._last_home: str | None = None
        self._scores: queue.Queue = queue.Queue(SCORE_BACKLOG)
        self.scores_dropped, self._dropped_reported, self._dropped_at = 0, 0, float("-inf")
        self._scorer = threading.Thread(target=self._score_loop, args=(priority,), name="onlinespec-scorer", daemon=True)
        self._scorer.start()

    def _read_state(self, config: ContentConfig) -> ContentRouter:
        """The router (and lifecycle) ``routing.json`` saved; a file that cannot be read (not JSON,
        fields missing or wrong) is quarantined, as the replay buffers' are, with an event that says
        where it went, and routing starts fresh (the drafts on disk stay and are reloaded on demand)."""
        if not self.path.exists():
            return ContentRouter(config)
        try:
            state = json.loads(self.path.read_text())
            router = ContentRouter.from_state(state["router"], config)
            evicted, retired = set(state.get("evicted", [])), dict(state.get("retired", {}))
            lifecycle, detections = dict(state.get("lifecycle", {})), dict(state.get("detections", {}))
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:  # an I/O error of the moment is raised
            moved = set_aside(self.path, self.path.parent / QUARANTINE)
            why = f"{type(err).__name__}: {err}"[:300]
            log.warning("content routing: %s could not be read (%s): moved to %s, starting with fresh routing", self.path, why, moved)
            self._said = {"event": "routing_quarantined", "moved": str(self.path), "to": str(moved), "error": why,
                          "time": time.time()}  # told at reopen: the pool that takes events is still being made
            return ContentRouter(config)
        self.evicted, self.retired = evicted, retired
        self.lifecycle.update(lifecycle)
        self.detections.update(detections)
        return router

    def reopen(self, saved: list[str], check: Callable[[str], None]) -> None:
        """At start-up, of the drafts a previous run saved: those in memory when it stopped are
        loaded again (up to ``max_in_memory``); the others, retired ones aside, wait in their
        registries (``check(name)`` refuses another model's now, not when its cluster returns)."""
        if self._said is not None:
            self.on_event(self._said)
            self._said = None
        with self.lock:
            state = json.loads(self.path.read_text()) if self.path.exists() else {}
            for name in saved:
                if name in self.retired:
                    continue
                if name in state.get("in_memory", []) and len(self.pool.drafts) < self.max_in_memory:
                    self.pool.open(name)
                else:
                    check(name)
                    self.evicted.add(name)

    # ---- requests ----------------------------------------------------------------------------

    def provisional(self, load: bool = True) -> PoolDraft | None:
        """The draft a request starts with until its prompt is prefilled and routed (its first
        round drafts nothing from a head: no target feature yet): the last routed request's.
        ``load=False``: only one already in memory (None if it would have to be loaded: model
        work, for the engine thread)."""
        with self.lock:
            name = self._last_home or next((k.draft for k in self.router.clusters.values() if k.live and k.draft), None)
            name = name if name and name not in self.retired else f"c{self.router.next_id}"
            return self._loaded(name) if load else self.pool.drafts.get(name)

    def route(self, embedding: torch.Tensor, hint: str | None = None, request_id: str | None = None) -> Route:
        """Route a prefilled request (engine thread): its cluster, the draft that records it, and
        the draft that serves it; spawns, reloads and evicts drafts as the router decides."""
        with self.lock:
            router = self.router
            assignment = router.assign(embedding, hint, request_id)
            self._apply_events()
            cluster = router.cluster(assignment.cluster)
            if cluster.draft is None or cluster.draft in self.retired:
                self._give_draft(cluster)
            home = self._loaded(cluster.draft)
            available = {n for n, d in self.pool.drafts.items() if d.learner is not None} | {STATIC}
            name = router.choose(cluster.id, available) or home.name
            self._apply_events()
            serve = self.static if name == STATIC else self.pool.drafts.get(name, home)
            for draft in {id(home): home, id(serve): serve}.values():
                draft.in_flight += 1
                draft.last_used = router.requests
            self._last_home, self._dirty = home.name, True
            return Route(serve, home, cluster.id, router._alias(assignment.member_of), assignment.request)

    def release(self, route: Route) -> None:
        """A routed request ended (answered, failed or cancelled)."""
        with self.lock:
            for draft in {id(route.home): route.home, id(route.serve): route.serve}.values():
                draft.in_flight = max(0, draft.in_flight - 1)

    def observed(self, route: Route, records: list, alpha: float, judged: int = 1) -> None:
        """After a routed request's records are stored (recorder thread): its alpha feeds its
        cluster's detector; its records wait for the scorer."""
        with self.lock:
            if judged:  # a request with nothing judged says nothing about alpha
                self.router.served(route.member_of, alpha)
            self._apply_events()
        if records:
            self._score_later((route.member_of, route.request, records))

    # ---- drafts in memory --------------------------------------------------------------------

    def _loaded(self, name: str) -> PoolDraft:
        """The draft called ``name``, in memory (reloaded from its registry if it was evicted)."""
        draft = self.pool.drafts.get(name)
        if draft is None:
            self._make_room(keep=name)
            draft = self.pool.open(name)
            if name in self.evicted:
                self.evicted.discard(name)
                self._lifecycle_event("reloaded", name)
        return draft

    def _give_draft(self, cluster: Cluster) -> None:
        """A live cluster without a draft of its own gets one, spawned from the draft that scores
        best on its requests (the starting draft when nothing scored it yet)."""
        parent = cluster.parent or self.router.best(cluster, learned_only=True)
        parent = parent if parent in self.pool.drafts or parent in self.evicted else None  # static: the starting draft
        name = f"c{cluster.id}"
        label = cluster.label()
        if label:
            name = f"c{cluster.id}-{draft_name(label)}"[:63]
        if name not in self.pool.drafts:  # (the first cluster's draft may exist already: the first request's provisional one)
            start = self._loaded(parent) if parent else None
            self._make_room(keep=name)
            self.pool.open(name, start_from=start)
        cluster.draft = name
        self.router.inherit(name, parent)
        self._lifecycle_event("spawned", name, cluster=cluster.id, parent=parent or "starting draft")

    def _make_room(self, keep: str) -> None:
        """Evict the least recently used idle drafts until one more fits in memory."""
        while len(self.pool.drafts) >= self.max_in_memory:
            idle = [d for n, d in self.pool.drafts.items() if n != keep and self._idle(d)]
            if not idle:  # serving or updating: housekeeping evicts when one is idle again (tick)
                log.info("%d drafts are in use or updating: one more is loaded beyond --max-drafts %d for now",
                         len(self.pool.drafts), self.max_in_memory)
                return
            self._evict(min(idle, key=lambda d: d.last_used).name)

    @staticmethod
    def _idle(draft: PoolDraft) -> bool:
        """Neither serving nor recording a request, nor updating: it may leave memory."""
        return draft.in_flight == 0 and not (draft.learner and draft.learner.busy)

    def _evict_idlest(self) -> bool:
        idle = [d for d in self.pool.drafts.values() if self._idle(d) and d.name != self._last_home]
        if idle:
            self._evict(min(idle, key=lambda d: d.last_used).name)
        return bool(idle)

    def _evict(self, name: str, why: str = "evicted") -> None:
        """Take a draft out of memory: its registry and buffer stay on disk; it is reloaded
        from them when its cluster comes back (unless a merge retired it)."""
        self.pool.unload(name)
        if why == "evicted":
            self.evicted.add(name)
            self._lifecycle_event("evicted", name)

    def _lifecycle_event(self, action: str, name: str, **more) -> None:
        self.lifecycle[action] += 1
        self._dirty = True
        self.on_event({"event": "draft_" + action, "draft": name, "in_memory": sorted(self.pool.drafts), **more})

    def _apply_events(self) -> None:
        """Carry out what the router decided, and log it."""
        router = self.router
        events, router.events = router.events, []
        for event in events:
            kind = event["event"]
            if kind == "drift":
                key = event["kind"]
                self.detections[key] = self.detections.get(key, 0) + 1
                target = self.pool.drafts.get(event.get("hurry") or (event.get("draft") if key == "alpha" else None))
                if target is not None and target.learner is not None:
                    target.learner.hurry()
                if key == "alpha" and event.get("shared"):  # a draft of its own, from the best scoring one
                    cluster = router.cluster(event["cluster"])
                    if cluster is not None:
                        cluster.draft = None
            elif kind == "cluster" and event.get("why") != "first":
                self.detections["new_cluster"] = self.detections.get("new_cluster", 0) + 1
            elif kind == "merge" and event.get("retired"):
                retired = event["retired"]
                self.retired[retired] = f"merged into {event['draft']} (cluster {event['merged']} joined {event['cluster']})"
                router.forget(retired)
                if retired in self.pool.drafts and self._idle(self.pool.drafts[retired]):  # else housekeeping does, once it is
                    self._evict(retired, why="retired")
                self.evicted.discard(retired)
                self.lifecycle["retired"] += 1
            self._dirty = True
            self.on_event({**event, "routed": router.requests})

    # ---- the scorer --------------------------------------------------------------------------

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
            with self.lock:
                self.on_event({"event": "scorer_behind", "dropped": dropped, "dropped_total": self.scores_dropped, "backlog": SCORE_BACKLOG})

    def _score_loop(self, priority: str) -> None:
        """Full-information scoring, in the background (one torch thread, the lowest priority):
        every learning draft in memory and the static one, on each recorded request's verified positions."""
        torch.set_num_threads(1)
        name_thread("onlinespec-score")
        lower_priority(priority)
        while (job := self._scores.get()) is not None:
            cluster, request, records = job
            try:
                with self.lock:
                    drafts = {STATIC: self.static, **{n: d for n, d in self.pool.drafts.items() if d.learner is not None}}
                alphas = self.pool.alphas(drafts, records)
                with self.lock:
                    self.router.score(cluster, alphas, request)
                    self._dirty = True
            except Exception:  # scoring is advice: serving and learning go on without it
                log.exception("scoring a request for content routing failed")

    # ---- housekeeping, persistence, operators ------------------------------------------------

    def tick(self) -> None:
        """Housekeeping (the pool's, every second or so): drafts that had to stay while busy leave
        once idle (those loaded past ``max_in_memory`` while the others were busy, and those a
        merge retired while they served); the state is saved if it changed."""
        try:
            with self.lock:
                while len(self.pool.drafts) > self.max_in_memory and self._evict_idlest():
                    pass
                for name in [n for n, d in self.pool.drafts.items() if n in self.retired and self._idle(d)]:
                    self._evict(name, why="retired")
            self.save()
        except Exception:  # never stops the housekeeping
            log.exception("content routing's housekeeping failed; serving goes on")

    def purge(self, request_id: str | None = None, before: float | None = None) -> None:
        """The far prompts of request ``request_id`` (or recorded before ``before``) leave the
        router, and its saved state, now."""
        with self.lock:
            if self.router.purge(request_id, before):
                self._dirty = True
        self.save(force=True)
        delete_set_aside_routing(self.path.parent)

    def save(self, force: bool = False) -> None:
        """Save the state (atomically; at most every SAVE_SECONDS unless ``force``)."""
        if not (self._dirty or force):
            return
        now = time.monotonic()
        if not force and now - self._saved_at < SAVE_SECONDS:
            return
        with self.lock:
            state = {"router": self.router.state(), "evicted": sorted(self.evicted), "retired": self.retired,
                     "lifecycle": self.lifecycle, "detections": self.detections, "in_memory": sorted(self.pool.drafts)}
            self._dirty, self._saved_at = False, now
        try:
            atomic_write(self.path, json.dumps(state))
        except OSError as err:
            log.error("the content router's state could not be saved: %s", err)

    def close(self) -> None:
        """At shutdown: the scorer scores its backlog and stops; the state is saved."""
        self._score_later(None)
        self._scorer.join(60)
        self.save(force=True)

    def report(self) -> dict:
        """Content routing's state for operators (clusters, lifecycle, detections)."""
        with self.lock:
            return {"clusters": self.router.summary(), "in_memory": sorted(self.pool.drafts), "evicted": sorted(self.evicted),
                    "retired": dict(self.retired), "lifecycle": dict(self.lifecycle), "detections": dict(self.detections),
                    "requests": self.router.requests, "scores_dropped": self.scores_dropped}


def delete_set_aside_routing(out_dir: str | Path) -> None:
    """Delete the unreadable routing states set aside in ``out_dir/quarantine``: none can be shown
    free of a purged request's far prompts."""
    for stale in (Path(out_dir) / QUARANTINE).glob(f"{ROUTING_FILE}.*"):
        stale.unlink(missing_ok=True)


def purge_saved_routing(out_dir: str | Path, request_id: str | None = None, before: float | None = None) -> int:
    """Purge a stopped server's content-routing state (``routing.json``): the far prompts of
    request ``request_id`` (or recorded before ``before``) leave it; how many went."""
    path = Path(out_dir) / ROUTING_FILE
    delete_set_aside_routing(out_dir)
    if not path.exists():
        return 0
    try:
        state = json.loads(path.read_text())
        router = ContentRouter.from_state(state["router"])
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):  # unreadable: nothing to keep of it
        path.unlink()
        return 0
    removed = router.purge(request_id, before)
    if removed:
        atomic_write(path, json.dumps({**state, "router": router.state()}))
    return removed
