"""What operators do and see: actions on the learners (pause, update, rollback, pin), purges
and retention of the training data, and the drafts' rows of ``GET /admin/drafts``. The serving
core and the Ray front (:mod:`onlinespec.scale`) answer the admin API through these, so a rule
(what a purge accepts, what a server that does not learn refuses) is written once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from onlinespec.cpu import name_thread
from onlinespec.online.pool import DraftPool, ServedDraft, learner_row
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import NotFound, ServeError
from onlinespec.serve.metrics import ServeMetrics

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
