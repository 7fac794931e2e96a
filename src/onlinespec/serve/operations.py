"""What operators do and see: actions on the learners (pause, update, rollback, pin), purges
and retention of the training data, and the drafts' rows of ``GET /admin/drafts``. The serving
core and the Ray front (:mod:`onlinespec.scale`) answer the admin API through these, so a rule
(what a purge accepts, what a server that does not learn refuses) is written once.
:class:`PoolOperations` is the admin side of :class:`~onlinespec.serve.interface.Core` for one
process: what :class:`~onlinespec.serve.core.ServingCore` answers over its own pool."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from onlinespec.cpu import name_thread
from onlinespec.online.pool import DraftPool, ServedDraft, learner_row
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import NotFound, ServeError
from onlinespec.serve.metrics import ServeMetrics
from onlinespec.storage import EventLog

if TYPE_CHECKING:
    from onlinespec.decoding.engine import SpeculativeEngine
    from onlinespec.serve.learning import LearningShare

TICK_SECONDS = 1.0  # housekeeping (retention, another process's rollback) at least this often


def require_learning(config: CoreConfig) -> None:
    """A server that does not learn has no learners to act on: every action is refused."""
    if not config.learning:
        raise ServeError("this server does not learn (started with --static or --draft none)", code="not_learning")


def operate(pool: DraftPool, action: str, name: str | None = None, version: str | None = None,
            run: Callable = lambda fn: fn()) -> dict:
    """An operator's action on a pool's learners: ``pause``, ``resume``, ``update`` (start
    ``name``'s update now), ``rollback`` (``name`` serves its current version's parent), ``pin``
    (``name`` serves ``version`` and publishes nothing; ``version=None`` unpins). ``run(fn)`` runs
    the model work (loading a version). A bad name, version or action is a :class:`ServeError`."""
    try:
        if action in ("pause", "resume"):
            pool.pause(action == "pause")
            return {"paused": pool.paused}
        if action == "update":
            if not pool.update_now(name):
                raise ServeError("an update is already running: wait for it (GET /admin/drafts shows it busy)", code="busy")
            return {"draft": name, "started": True}
        if action == "rollback":
            pool.learned(name).learner.stop()  # here, so that the engine never waits for an update to end
            return {"draft": name, "version": run(lambda: pool.rollback(name))}
        if action == "pin":
            if version is not None:
                pool.learned(name).learner.stop()
            run(lambda: pool.pin(name, version))
            return {"draft": name, "version": pool.drafts[name].learner.registry.current(), "pinned": version is not None}
        raise ServeError(f"unknown action {action!r}")
    except KeyError as err:
        raise NotFound(err.args[0], param="draft") from None
    except FileNotFoundError as err:
        raise NotFound(str(err), param="version") from None
    except ValueError as err:
        raise ServeError(str(err)) from None


def purge_cutoff(request_id: str | None, older_than_days: float | None) -> float | None:
    """Check a purge's arguments (exactly one of a request id and an age); return the time
    before which records go (None: a purge by request id)."""
    if (request_id is None) == (older_than_days is None):
        raise ServeError("give exactly one of request_id and older_than_days", code="invalid_purge")
    if older_than_days is not None and not older_than_days >= 0:
        raise ServeError(f"older_than_days must be >= 0, got {older_than_days}", param="older_than_days")
    return None if older_than_days is None else time.time() - older_than_days * 86400.0


def draft_rows(pool: DraftPool, baselines: dict[str, ServedDraft]) -> list[dict]:
    """Every draft: what it serves, its versions (with their metadata), its learner's state."""
    rows = []
    for name, draft in [*pool.drafts.items(), *baselines.items()]:
        row = {"name": name, "version": draft.version, "learning": draft.learner is not None}
        if draft.suffix is not None:
            row["suffix_index"] = draft.suffix.stats()
        if draft.learner is not None:
            row.update(learner_row(draft.learner))
        rows.append(row)
    if pool.content is not None:  # content routing: where each draft is, and what it serves
        routing = pool.content.report()
        homes: dict[str, list[int]] = {}
        for cluster in routing["clusters"]:
            homes.setdefault(cluster["draft"], []).append(cluster["cluster"])
        for row in rows:
            row.update(state="in memory", clusters=homes.get(row["name"], []))
        rows += [{"name": n, "state": "evicted (in its registry; reloaded when its cluster returns)", "clusters": homes.get(n, []),
                  "learning": True} for n in routing["evicted"]]
        rows += [{"name": n, "state": f"retired: {why}", "learning": False} for n, why in routing["retired"].items()]
    return rows


def housekeep(pool: DraftPool, metrics: ServeMetrics, stopping: Callable[[], bool]) -> None:
    """A thread's loop, every TICK_SECONDS until ``stopping()``: retention, and a CURRENT another
    process changed (a rollback loads a version here, on one torch thread: never on the recorder,
    so answers never wait for it)."""
    name_thread("onlinespec-house")
    torch.set_num_threads(1)
    while not stopping():
        time.sleep(TICK_SECONDS)
        try:
            pool.tick()
        except Exception:  # retention runs again next tick; the failure is on /metrics
            metrics.housekeeping_failures.inc()
            logging.getLogger("onlinespec.serve").exception("housekeeping failed (retention, a CURRENT from another process); "
                                                            "it runs again in %s s", TICK_SECONDS)


class PoolOperations:
    """What an operator sees and does in one process (the admin API's half of
    :class:`~onlinespec.serve.interface.Core`), over the attributes below, which the class that
    takes it as a base (:class:`~onlinespec.serve.core.ServingCore`) holds once loaded."""

    config: CoreConfig
    pool: DraftPool
    baselines: dict[str, ServedDraft]
    share: LearningShare | None  # when learning takes the engine's turns
    metrics: ServeMetrics
    events: EventLog
    engine: SpeculativeEngine
    event: Callable[[dict], None]  # an event-log line
    on_engine: Callable[[Callable], object]  # run model work on the engine thread, between two steps

    def drafts(self) -> list[dict]:
        """Every draft (:func:`draft_rows`), the baselines included."""
        return draft_rows(self.pool, self.baselines)

    def replica_rows(self) -> list[dict]:
        """The serving replicas (one process: none; see onlinespec.scale)."""
        return []

    def routing(self) -> dict:
        """Content routing's clusters, lifecycle counts and detections (empty for other routers)."""
        return self.pool.content.report() if self.pool.content is not None else {}

    def learning(self) -> dict:
        """Whether the drafts learn and, when learning takes the engine's turns, the engine time it
        takes (:meth:`LearningShare.state`)."""
        state = {"learning": self.config.learning, "paused": self.pool.paused, "busy": self.pool.busy}
        return {**state, **self.share.state()} if self.share is not None else state

    def governance(self) -> dict:
        """What the core did with the training data (:meth:`DraftPool.governance`)."""
        return self.pool.governance()

    def purge(self, request_id: str | None = None, older_than_days: float | None = None) -> dict:
        """Delete a request's training records (or those older than a number of days) now."""
        before = purge_cutoff(request_id, older_than_days)
        indexed = self.pool.suffix_purged
        removed = self.pool.purge(request_id, before)
        purge_prefix = getattr(self.engine.runner, "purge_prefix", None)  # the prefix cache's cells it made go too (llama.cpp)
        cached = self.on_engine(lambda: purge_prefix(request_id, before)) if purge_prefix is not None else 0
        indexed = self.pool.suffix_purged - indexed
        self.events.drop(request_id, before)  # the log's lines about it go too (with --log-text they hold its text)
        self.event({"event": "purge", "request_id": request_id, "older_than_days": older_than_days, "records": removed,
                    "suffix_requests": indexed, "prefix_cache_cells": cached})
        return {"records_deleted": removed, "suffix_requests_deleted": indexed, "prefix_cache_cells_deleted": cached,
                "governance": self.governance()}

    def operate(self, action: str, name: str | None = None, version: str | None = None) -> dict:
        """An operator's action (:func:`operate`); the model work of a rollback or a pin runs on
        the engine thread. Returns the new state."""
        require_learning(self.config)
        result = operate(self.pool, action, name, version, self.on_engine)
        if action in ("pause", "resume"):
            result = self.learning()
        if name in self.pool.drafts and action in ("rollback", "pin"):
            self.metrics.serving(name, self.pool.drafts[name].learner.registry.current())
        self.event({"event": "admin", "action": action, "draft": name, "version": version, "result": result})
        return result
