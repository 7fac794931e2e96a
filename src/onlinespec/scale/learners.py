"""A draft group's learners in a Ray actor, and a serving replica's client of them.

:class:`LearnerService` (the actor, :func:`learner_actor`) is a :class:`DraftPool` without
proposing: for every draft of its group it owns the durable replay buffer, runs the updates (arXiv
2310.07177, section 4.2: every I requests, in the background, one at a time, the learner thread at
the lowest OS priority) and publishes to the draft's registry. After each publication, or a
rollback, it tells every replica to follow the registry.

:class:`RemoteLearner` stands where a replica's draft keeps its learner. It sends each served
request's records to the actor and returns once they are on the actor's disk (so a replica that
dies right after answering lost nothing it acknowledged), and it serves whatever version the
registry's CURRENT names: pushed by the actor after a publication, checked again every second.
A replica never writes CURRENT: only the learner actor (and an operator through it) does.

A store the actor retries after a restart is stored once: the actor keeps the request ids it
stored (rebuilt from its buffer on restart) and skips a request it has.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import ray
import torch

from onlinespec.factory import make_proposer
from onlinespec.models import load_model
from onlinespec.online.learner import LearnerConfig
from onlinespec.online.pool import DraftPool, learner_row, saved_drafts
from onlinespec.online.publisher import load_version
from onlinespec.online.recorder import records_from_generation
from onlinespec.online.registry import DraftRegistry
from onlinespec.routing.domains import Router
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import NotFound, ServeError
from onlinespec.serve.operations import operate
from onlinespec.storage import EventLog, OutDirLock
from onlinespec.tokens import tokenizer_fingerprint

log = logging.getLogger("onlinespec.scale")

STORE_TIMEOUT = 120.0  # seconds a replica waits for the learner actor to store a request's records (a restart included)
SEEN_IDS = 100_000  # request ids a learner actor remembers having stored (retried stores are skipped)
TICK_SECONDS = 1.0


def group_of(name: str, groups: int) -> int:
    """The learner group that owns draft ``name`` (stable across processes and restarts)."""
    return zlib.crc32(name.encode()) % groups


def learner_actor_name(group: int) -> str:
    return f"learner-{group}"


def replica_actor_name(replica: str) -> str:
    return f"replica-{replica}"


class LearnerService:
    """The learners of one draft group (see the module docstring); every method may be called
    concurrently (the actor runs a few calls at a time)."""

    def __init__(self, config: CoreConfig, out_dir: str, group: int, groups: int, replicas: list[str]) -> None:
        torch.set_num_threads(config.learner.threads)
        self.config, self.out_dir, self.group, self.groups, self.replicas = config, Path(out_dir), group, groups, replicas
        self.own_dir = self.out_dir / "learners" / str(group)
        self.lock = OutDirLock(self.own_dir).acquire()  # one live learner actor per group and out-dir
        self.events = EventLog(self.own_dir / "events.jsonl", config.retention_seconds)
        target = load_model(config.target, config.dtype)
        self.identity = {"target": config.target, "draft": config.draft, "tokenizer": tokenizer_fingerprint(target.tokenizer)}

        def new_draft():
            return make_proposer(config.draft, target, config.dtype).proposer, None

        self.pool = DraftPool(new_draft, self.out_dir, Router("single"), config.pool_config(self.identity), on_event=self._event,
                              owns=lambda name: group_of(name, groups) == group)
        self._seen: dict[str, OrderedDict] = {}
        self._seen_lock = threading.Lock()
        for name in saved_drafts(self.out_dir):  # a restart: the group's drafts, from their registries and buffers
            if group_of(name, groups) == group:
                self._open(name)
        self._stopping = threading.Event()
        self.housekeeping_failures = 0
        threading.Thread(target=self._housekeeping, name="onlinespec-learner-housekeeping", daemon=True).start()
        self._event({"event": "learner_actor_start", "group": group, "pid": os.getpid(), "drafts": sorted(self.pool.drafts)})

    def _open(self, name: str):
        if group_of(name, self.groups) != self.group:
            raise ValueError(f"draft {name!r} belongs to learner group {group_of(name, self.groups)}, not {self.group}")
        draft = self.pool.open(name)
        with self._seen_lock:
            if name not in self._seen:
                self._seen[name] = OrderedDict.fromkeys(r.digest() for r in draft.learner.buffer.records())
        return draft

    def _housekeeping(self) -> None:
        torch.set_num_threads(1)
        while not self._stopping.wait(TICK_SECONDS):
            try:
                self.pool.tick()  # retention, and a CURRENT another process changed
            except Exception:  # it runs again next tick
                self.housekeeping_failures += 1
                logging.getLogger("onlinespec.scale").exception("learner housekeeping failed; it runs again in %s s", TICK_SECONDS)

    def _event(self, event: dict) -> None:
        event = self.events.write({**event, "learner_group": self.group})
        if event["event"] in ("update", "rollback") and event.get("version"):
            self.tell_replicas()

    def tell_replicas(self) -> None:
        """Every replica serves the registry's CURRENT from its next step (a push, not awaited)."""
        for replica in self.replicas:
            try:
                ray.get_actor(replica_actor_name(replica)).follow.remote()
            except Exception:  # not started yet, or restarting: it reads CURRENT when it (re)starts
                pass

    # ---- what replicas call ------------------------------------------------------------------

    def ready(self) -> dict:
        return {"group": self.group, "pid": os.getpid(), "drafts": sorted(self.pool.drafts)}

    def open(self, name: str) -> dict:
        """Open draft ``name`` (its registry gets its starting version if it is new); its state."""
        return self.state(self._open(name).name)

    def store(self, name: str, records: list, new_tokens: int) -> dict:
        """Store a served request's records durably (records already stored, the same content
        again, are skipped) and start the update due longest when the slot is free; whether
        they were all stored (on the learner's disk) when this returns."""
        self._open(name)
        ids = {r.digest() for r in records}
        with self._seen_lock:
            seen = self._seen[name]
            if ids and all(i in seen for i in ids):
                return {"stored": True, "state": self.state(name)}
        stored = self.pool.store(name, records, new_tokens)
        with self._seen_lock:
            for i in ids:
                seen[i] = None
            while len(seen) > SEEN_IDS:
                seen.popitem(last=False)
        return {"stored": stored, "state": self.state(name)}

    def state(self, name: str) -> dict:
        """Draft ``name``'s learner, as a replica caches it (busy, pinned, failures, buffer counts)."""
        learner = self.pool.learned(name).learner
        return {"busy": learner.busy, "pinned": learner.pinned, "stopped": learner.stopped, "failures": list(learner.failures),
                "governance": learner.governance(), "current": learner.registry.current()}

    # ---- what the front (RayCore) calls ----------------------------------------------------------

    def drafts(self) -> list[dict]:
        """Every draft of the group, as the admin API lists it."""
        return [{"name": name, "version": draft.learner.registry.current(), "learning": True, "learner_group": self.group,
                 "learner_pid": os.getpid(), **learner_row(draft.learner)}
                for name, draft in sorted(self.pool.drafts.items())]

    def learning(self) -> dict:
        return {"paused": self.pool.paused, "busy": self.pool.busy}

    def operate(self, action: str, name: str | None = None, version: str | None = None) -> dict | ServeError:
        """An operator's action (:func:`onlinespec.serve.operations.operate`); an error comes back as a
        value (a :class:`ServeError`), so that the front maps it to its HTTP status."""
        try:
            if name is not None and name not in self.pool.drafts:
                raise NotFound(f"no learning draft {name!r}; drafts: {sorted(self.pool.drafts) or 'none yet'}", param="draft")
            result = operate(self.pool, action, name, version)
        except ServeError as err:
            return err
        self._event({"event": "admin", "action": action, "draft": name, "version": version, "result": result})
        if action in ("rollback", "pin"):
            self.tell_replicas()
        return result

    def purge(self, request_id: str | None = None, before: float | None = None) -> int:
        removed = self.pool.purge(request_id, before)
        self.events.drop(request_id, before)  # this actor's own log (its updates' lines)
        with self._seen_lock:  # no digest of a purged record is kept either
            for name in self._seen:
                self._seen[name] = OrderedDict.fromkeys(r.digest() for r in self.pool.drafts[name].learner.buffer.records())
        return removed

    def governance(self) -> dict:
        return self.pool.governance()

    def shutdown(self) -> None:
        """Abandon an update in flight (it publishes nothing) and let the group's files go."""
        self._stopping.set()
        for learner in self.pool.learners:
            learner.stop(timeout=60)
        self.events.close()
        self.lock.release()


def learner_actor(cpus: float):
    """The Ray actor class of :class:`LearnerService`: restarted by Ray when its process dies
    (from the registry's CURRENT and its durable buffer), calls to it retried across a restart."""
    return ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=cpus, max_concurrency=8)(LearnerService)


class RemoteLearner:
    """Where a replica's draft keeps its learner: the parts of
    :class:`~onlinespec.online.learner.OnlineLearner` that serving uses, backed by the learner
    actor (see the module docstring)."""

    def __init__(self, name: str, proposer, actor, registry: DraftRegistry, config: LearnerConfig, on_event=None) -> None:
        self.name, self.proposer, self.actor, self.registry, self.config = name, proposer, actor, registry, config
        self.on_event = on_event or (lambda event: None)
        self._lock = threading.Lock()
        self._state = ray.get(actor.open.remote(name), timeout=STORE_TIMEOUT)  # the actor publishes a new draft's start
        self._current: str | None = None
        self._unloadable: str | None = None
        self.write_failures = 0
        self.due, self.due_since, self.reports, self.pruned = False, None, [], []  # the actor decides and keeps these
        self.follow_registry()
        proposer.take_swap()  # nothing is served with it yet

    # what serving reads, as the actor last reported it
    busy = property(lambda self: self._state["busy"])
    pinned = property(lambda self: self._state["pinned"])
    stopped = property(lambda self: self._state["stopped"])
    failures = property(lambda self: self._state["failures"])

    @property
    def version(self) -> str | None:
        """The version handed to the proposer (served from its next round)."""
        return self._current

    def governance(self) -> dict:
        return self._state["governance"]

    def records_next(self, headroom: float = 1.0) -> bool:
        """Whether the next request is recorded: always. Replicas' updates run in the learner actor,
        which no learning controller backs off, so their recording does not back off either."""
        return True

    def records(self, generation, domain: str = "default", request_id: str = "") -> list:
        return records_from_generation(generation, self.config.position_policy, self.config.sampling, domain, request_id)

    def observe(self, generation, domain: str = "default", request_id: str = "", train: bool = True, start: bool = False) -> bool:
        return train and self.observe_records(self.records(generation, domain, request_id), len(generation.token_ids))

    def observe_records(self, records: list, new_tokens: int, start: bool = False) -> bool:
        """Store the records with the learner actor; True once they are on its disk. An actor
        that does not answer within STORE_TIMEOUT (it stays down) costs the records, counted
        as a write failure, never the answer."""
        try:
            reply = ray.get(self.actor.store.remote(self.name, records, new_tokens), timeout=STORE_TIMEOUT)
        except Exception as err:
            self.write_failures += 1
            log.error("draft %s: the learner actor did not store a request's records (%s: %s); serving goes on",
                      self.name, type(err).__name__, err)
            return False
        self._state = reply["state"]
        return reply["stored"]

    def follow_registry(self) -> str | None:
        """Serve the version CURRENT names if it is not the one served (between two rounds); the
        version now served if it changed. A version that fails to load is tried once."""
        with self._lock:
            try:
                current = self.registry.current()
                if not current or current in (self._current, self._unloadable) or current not in self.registry.versions():
                    return None
            except OSError:  # a moment's trouble reading the registry: the next call looks again
                return None
            try:
                model = load_version(self.proposer.model, self.registry, current)
            except Exception as err:
                self._unloadable = current
                log.error("draft %s: CURRENT names %s, which could not be served (%s); serving %s", self.name, current, err, self._current)
                return None
            self.proposer.swap_model(model, current)
            self._current = current
        self.on_event({"event": "version", "version": current, "time": time.time()})
        return current

    # the actor runs the updates: a replica starts, stops and expires nothing
    def maybe_update(self) -> bool:
        return False

    def update_now(self) -> bool:
        return False

    def hurry(self) -> None:
        pass

    def stop(self, timeout: float | None = None) -> None:
        pass

    def wait(self, timeout: float | None = None) -> None:
        pass

    def expire(self) -> int:
        return 0

    def purge(self, request_id: str | None = None, before: float | None = None) -> int:
        return 0

    def serve_version(self, version: str) -> None:
        raise ServeError("a replica serves what its learner actor publishes: roll back or pin through the front's admin API")
