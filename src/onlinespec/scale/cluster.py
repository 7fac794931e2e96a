"""The front of a Ray deployment: what the OpenAI-compatible app serves from when there are replicas.

:class:`RayCore` implements the serving core's declared interface, :class:`~onlinespec.serve.interface.Core`
(``submit``, ``drafts``, ``operate``, ``purge``, ``metrics``, ``load``, ``shutdown``, ...), as
:class:`~onlinespec.serve.core.ServingCore` does, so that :func:`onlinespec.serve.app.create_app`
serves one replica or N with the same code. It:

- starts (or joins, ``address``) a Ray cluster, one learner actor per draft group, then the
  replica actors, each a whole serving core on its own CPUs;
- sends each request to the ready replica with the fewest requests in flight and relays its
  events (one stream per replica carries every request's, batched per engine step); a replica
  that dies mid-request fails the request with 503 (send it again), or, when nothing of its
  answer was sent yet, sends it to another replica; Ray restarts the replica, and a health check
  every ``HEALTH_SECONDS`` puts it back in rotation;
- fans operators out: learning and rollbacks go to the learner actors (which publish and tell the
  replicas), purges to every learner and replica, ``/metrics`` merges every replica's metrics with a
  ``replica`` label.

The out-dir is shared: ``drafts/`` (registries: the learner actors write, replicas read),
``buffer/`` (the learner actors'), ``replicas/<name>/`` and ``learners/<group>/`` (their event logs
and locks), and ``events.jsonl`` of the front. On a cluster of several machines it must be a shared
file system (docs/scale.md).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import ray

from onlinespec.cpu import PLUMBING_NICE, keep_other_threads_lowered
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.scale.learners import group_of, learner_actor, learner_actor_name, replica_actor_name
from onlinespec.scale.metrics import ClusterMetrics
from onlinespec.scale.replicas import ACCEPTED, replica_actor
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import Events, Failed, LoadFailed, Overloaded, Served, ServeError, Unavailable
from onlinespec.serve.interface import Core
from onlinespec.serve.logs import LogSettings
from onlinespec.serve.operations import purge_cutoff, require_learning
from onlinespec.storage import EventLog, OutDirLock
from onlinespec.tokens import Prompt

log = logging.getLogger("onlinespec.scale")

HEALTH_SECONDS = 2.0  # how often the front checks its replicas (a restarted one rejoins the rotation)
CALL_TIMEOUT = 60.0  # seconds an operator's call to an actor may take
RELAY_JOIN_SECONDS = 10.0  # at shutdown, how long the front waits for a stopped replica's events stream to end


@dataclass
class ScaleConfig:
    replicas: int = 2
    address: str | None = None  # an existing Ray cluster ("auto", "ray://host:10001"); None: start a local one
    replica_cpus: float | None = None  # Ray CPUs (and torch threads) per replica; None: this machine's cores / replicas
    learner_cpus: float = 1.0  # Ray CPUs per learner actor (it runs LearnerConfig.threads torch threads, at low priority)
    learner_groups: int = 1  # learner actors; draft d belongs to group crc32(d) % learner_groups
    plumbing_nice: int = PLUMBING_NICE  # nice of the threads that only carry messages: the front's, and a replica's but
    # its engine's (docs/scale.md: Ray's cost on a machine that serving saturates); 0 leaves them at the caller's
    logs: LogSettings = LogSettings()  # each replica's log (--log-level, --log-format), as the front's

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.learner_groups < 1:
            raise ValueError(f"replicas and learner_groups must be >= 1, got {self.replicas} and {self.learner_groups}")
        if self.replica_cpus is not None and not self.replica_cpus > 0:
            raise ValueError(f"replica_cpus must be > 0, got {self.replica_cpus}")
        if not self.learner_cpus >= 0:
            raise ValueError(f"learner_cpus must be >= 0, got {self.learner_cpus}")

    @property
    def cpus_per_replica(self) -> float:
        return self.replica_cpus or max(1, (os.cpu_count() or 1) // self.replicas)


@dataclass
class Replica:
    name: str
    actor: object
    ready: bool = False
    pid: int | None = None
    restarts: int = 0
    served: int = 0
    chosen: int = 0  # when it was last given a request (ties go to the least recent)
    open: dict = field(default_factory=dict)  # key -> RemoteHandle: the requests it serves now (its load)
    channel: threading.Thread | None = None  # relays its events stream


class RemoteHandle(Events):
    """A request a replica serves: its events relayed by the front."""

    def __init__(self, core: RayCore, request: dict, notify: Callable[[], None] | None) -> None:
        super().__init__(notify)
        self.core, self.request, self.request_id = core, request, request["request_id"]
        self.key = uuid.uuid4().hex  # the front's own name for it (clients may reuse request ids)
        self.replica: Replica | None = None
        self.cancelled = self.retried = False
        self.sent = False  # some of its answer went to the client (a retry elsewhere would repeat it)

    def cancel(self) -> None:
        self.cancelled = True
        replica = self.replica
        if replica is not None and not self.done:
            replica.actor.cancel.remote(self.key)
            self.core._detach(self, replica)


def ray_namespace(out_dir: Path) -> str:
    """One Ray namespace per out-dir: two deployments on one cluster never share actors."""
    return "onlinespec-" + hashlib.sha1(str(out_dir).encode()).hexdigest()[:10]


def replica_states(replicas: list[Replica]) -> list[dict]:
    """Each replica's row as the front knows it, with what a ready one says of itself (its
    versions, suffix indices, baselines, governance)."""
    states = []
    for replica in replicas:
        row = {"name": replica.name, "ready": replica.ready, "pid": replica.pid, "in_flight": len(replica.open),
               "restarts": replica.restarts, "served": replica.served}
        if replica.ready:
            try:
                row.update(ray.get(replica.actor.state.remote(), timeout=10))
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"
        states.append(row)
    return states


def learner_call(learners: list, method: str, *args, group: int | None = None, timeout: float = CALL_TIMEOUT) -> list:
    """Call ``method`` on every learner actor (or group ``group``'s) and wait for their answers."""
    learners = learners if group is None else [learners[group]]
    try:
        return ray.get([getattr(learner, method).remote(*args) for learner in learners], timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise Unavailable(f"the learner actors did not answer within {timeout:g} s (restarting?); retry") from None


class RayCore(Core):
    """The serving core of a Ray deployment (:class:`~onlinespec.serve.interface.Core`): a front
    over serving replicas and learner actors."""

    def __init__(self, config: CoreConfig, out_dir: str | Path, scale: ScaleConfig | None = None) -> None:
        if config.router == "content":
            raise ValueError("content routing runs in a single process for now: serve replicas with --router domain or single")
        self.config, self.scale, self.out_dir = config, scale or ScaleConfig(), Path(out_dir).resolve()
        self.lock = OutDirLock(self.out_dir).acquire()  # the front holds the out-dir; replicas and learners their folders in it
        self.events = EventLog(self.out_dir / "events.jsonl")
        self.status, self.error, self.context = "starting", None, None
        self.started_at = time.time()
        self.replicas: list[Replica] = []
        self.learners: list = []
        self._lock = threading.Lock()
        self._stopping, self._stopped = threading.Event(), threading.Event()
        self._chosen = 0
        self._started_ray = False
        self.metrics = ClusterMetrics(lambda: self.replicas)

    @property
    def ready(self) -> bool:
        return self.status == "ready" and any(r.ready for r in self.replicas)

    @cached_property
    def tokenizer(self):
        """The target's tokenizer, for what the front says about tokens (log probabilities, echo)."""
        from onlinespec.models import load_tokenizer

        tokenizer = load_tokenizer(self.config.target)
        if self.config.chat_template is not None:  # --chat-template: the replicas' too
            tokenizer.chat_template = self.config.chat_template
        return tokenizer

    # ---- start and stop ---------------------------------------------------------------------

    def load(self) -> None:
        """Start (or join) Ray, the learner actors, then the replicas; block until every replica
        has loaded and calibrated. One thread starts Ray and lives until :meth:`shutdown`: a
        local cluster's processes die with the thread that started them (Linux's parent-death
        signal follows the thread), and it runs the health checks."""
        loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(loaded,), name="onlinespec-ray", daemon=True)
        self._thread.start()
        loaded.wait()
        if self.status == "failed":
            raise LoadFailed(f"the Ray deployment failed to start: {self.error}")

    def _run(self, loaded: threading.Event) -> None:
        try:
            self._start()
        except Exception as err:
            self.status, self.error = "failed", f"{type(err).__name__}: {err}"
            self.event({"event": "load_failed", "error": self.error})
            if self._started_ray and ray.is_initialized():
                ray.shutdown()  # else this process would wait for a cluster that is gone, then exit
            return
        finally:
            loaded.set()
        self._health()
        self._stopped.wait()  # shutdown has stopped the actors; Ray stops when this thread ends
        if self._started_ray and ray.is_initialized():
            ray.shutdown()

    def _start(self) -> None:
        self.status = "loading"
        scale, config = self.scale, self.config
        if not ray.is_initialized():
            options = {"namespace": ray_namespace(self.out_dir), "include_dashboard": False, "log_to_driver": True}
            if scale.address is None:  # a local cluster sized for what it runs (learners at low priority share the cores)
                need = scale.replicas * scale.cpus_per_replica + scale.learner_groups * scale.learner_cpus
                options["num_cpus"] = max(os.cpu_count() or 1, math.ceil(need))
            ray.init(address=scale.address, **options)
            self._started_ray = True
        names = [f"r{i}" for i in range(scale.replicas)]
        cores = os.cpu_count() or 1
        if scale.address is None and config.learning and config.learner.priority == "low" and scale.replicas * scale.cpus_per_replica >= cores:
            # measured on 2 cores, 2 replicas: the learner actor got 4% of a core, one update took 520 s (docs/scale.md)
            log.warning("the replicas' %g CPUs fill this machine's %d cores: a learner actor at --priority low only gets the "
                        "CPU time they leave, and its updates may take minutes; give it a core of its own (fewer replicas or "
                        "--replica-cpus) or run it at --priority normal", scale.replicas * scale.cpus_per_replica, cores)
        if config.learning:
            actor = learner_actor(scale.learner_cpus)
            self.learners = [actor.options(name=learner_actor_name(g)).remote(config, str(self.out_dir), g, scale.learner_groups, names)
                             for g in range(scale.learner_groups)]
            ray.get([learner.ready.remote() for learner in self.learners])
        cpus = scale.cpus_per_replica
        actor = replica_actor(cpus)
        self.replicas = [Replica(name, actor.options(name=replica_actor_name(name)).remote(
            config, str(self.out_dir), name, self.learners, max(1, int(cpus)), scale.plumbing_nice, scale.logs)) for name in names]
        for replica, state in zip(self.replicas, ray.get([r.actor.ready.remote() for r in self.replicas])):
            replica.ready, replica.pid = True, state["pid"]
            self.context = state["context"]
            self._open_channel(replica)
        if scale.plumbing_nice:  # this process only relays now; its threads and those they start later
            keep_other_threads_lowered(scale.plumbing_nice)
        self.status = "ready"
        self.event({"event": "start", "replicas": names, "learner_groups": scale.learner_groups, "address": scale.address,
                    "replica_cpus": cpus, "learner_cpus": scale.learner_cpus, "learn": config.learning, "draft": config.draft})

    def shutdown(self, drain_seconds: float = 30.0) -> None:
        """Every replica drains (its requests in flight finish, at most ``drain_seconds``) and
        writes its records; the learners abandon an update in flight; Ray stops if we started it."""
        self._stopping.set()
        if self.status == "ready":
            self.status = "draining"
            calls = [r.actor.shutdown.remote(drain_seconds) for r in self.replicas]
            for call in calls:
                try:
                    ray.get(call, timeout=drain_seconds + 120)
                except Exception as err:
                    log.error("a replica did not stop cleanly: %s", err)
            for learner in self.learners:
                try:
                    ray.get(learner.shutdown.remote(), timeout=120)
                except Exception as err:
                    log.error("a learner actor did not stop cleanly: %s", err)
            # a relay thread still inside Ray when Ray stops would make Ray end this process (exit 1);
            # each one's stream ends once its replica has stopped
            for replica in self.replicas:
                if replica.channel is not None:
                    replica.channel.join(RELAY_JOIN_SECONDS)
                    if replica.channel.is_alive():
                        log.error("replica %s's events stream did not end within %g s", replica.name, RELAY_JOIN_SECONDS)
        self.event({"event": "stop", "replicas": [{"name": r.name, "served": r.served, "restarts": r.restarts} for r in self.replicas]})
        self.status = "stopped"
        self._stopped.set()
        if getattr(self, "_thread", None) is not None:
            self._thread.join(60)
        self.events.close()
        self.lock.release()

    def _health(self) -> None:
        """Every HEALTH_SECONDS: which replicas answer; a restarted one (a new pid) rejoins."""
        while not self._stopping.wait(HEALTH_SECONDS):
            for replica in self.replicas:
                try:
                    state = ray.get(replica.actor.ready.remote(), timeout=5)
                except Exception:
                    self._down(replica, "no answer to the health check")
                    continue
                if state["status"] != "ready":
                    continue
                if replica.pid is not None and state["pid"] != replica.pid:
                    replica.restarts += 1
                    self.event({"event": "replica_restarted", "replica": replica.name, "pid": state["pid"], "restarts": replica.restarts})
                if not replica.ready:
                    self.event({"event": "replica_ready", "replica": replica.name, "pid": state["pid"]})
                replica.pid = state["pid"]
                self._open_channel(replica)
                replica.ready = True

    def _down(self, replica: Replica, why: str) -> None:
        if replica.ready:
            replica.ready = False
            self.event({"event": "replica_down", "replica": replica.name, "why": why})

    # ---- requests --------------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, domain: str = "default", train: bool = True,
               draft: str | None = None, request_id: str | None = None,
               notify: Callable[[], None] | None = None, stream: bool = False, tenant: str = "", cache_salt: str | None = None,
               priority: int = 0) -> RemoteHandle:
        """Queue a request on a replica (as :meth:`ServingCore.submit`; the same errors)."""
        if not self.ready:
            raise Unavailable(f"not ready: {self.error or 'no replica is ready'}; retry when GET /ready answers 200")
        request = {"prompt": prompt, "params": params, "domain": domain, "train": train, "draft": draft,
                   "request_id": request_id or f"req-{uuid.uuid4().hex[:16]}", "stream": stream,
                   "tenant": tenant, "cache_salt": cache_salt, "priority": priority}
        handle = RemoteHandle(self, request, notify)
        self._place(handle)
        return handle

    def _place(self, handle: RemoteHandle, avoid: Replica | None = None) -> None:
        """Queue the request on the ready replica with the fewest in flight; a full or dead
        replica passes it on; raise the refusal when none takes it."""
        refusal: ServeError | None = None
        tried: set[str] = {avoid.name} if avoid else set()
        while (replica := self._reserve(handle, tried)) is not None:
            tried.add(replica.name)
            try:
                answer = ray.get(replica.actor.submit.remote(handle.key, handle.request), timeout=CALL_TIMEOUT)
            except Exception as err:
                self._detach(handle, replica)
                if isinstance(err, ray.exceptions.RayTaskError):  # the replica raised (a bug): every replica would
                    raise Failed(f"replica {replica.name} could not take the request: {err}") from None
                self._down(replica, f"{type(err).__name__}")  # it died (or is restarting): the next one
                continue
            if answer == ACCEPTED:
                return
            self._detach(handle, replica)
            if isinstance(answer, Overloaded):  # its queue is full: another may have room
                refusal = answer
                continue
            raise answer  # the request itself is wrong: every replica would say so
        raise refusal or Unavailable("no replica could take the request (they are restarting); retry in a few seconds")

    def _detach(self, handle: RemoteHandle, replica: Replica) -> None:
        with self._lock:
            replica.open.pop(handle.key, None)

    def _open_channel(self, replica: Replica) -> None:
        if replica.channel is None or not replica.channel.is_alive():
            replica.channel = threading.Thread(target=self._relay, args=(replica,), name=f"onlinespec-relay-{replica.name}", daemon=True)
            replica.channel.start()

    def _relay(self, replica: Replica) -> None:
        """Pass a replica's events to their handles, until its stream ends (it died, or stops)."""
        lost: Exception | None = None
        try:
            for ref in replica.actor.events.remote():
                for key, events in ray.get(ref):
                    handle = replica.open.get(key)
                    if handle is None:  # cancelled meanwhile
                        continue
                    for event in events:
                        handle.sent = handle.sent or not isinstance(event, (Served, ServeError))
                        handle.emit(event)
                        if isinstance(event, (Served, ServeError)):
                            replica.served += isinstance(event, Served)
                            self._detach(handle, replica)
        except Exception as err:
            lost = err
        if self._stopping.is_set():
            return
        self._down(replica, f"its events stream ended ({type(lost).__name__ if lost else 'closed'})")
        self._lost(replica, lost)

    def _lost(self, replica: Replica, err: Exception | None) -> None:
        """A replica died with requests in flight: one none of whose answer was sent goes to
        another replica, once; the others fail (send them again)."""
        with self._lock:
            handles, replica.open = list(replica.open.values()), {}
        why = type(err).__name__ if err else "stopped"
        for handle in handles:
            if handle.cancelled or handle.done:
                continue
            if not handle.sent and not handle.retried:
                handle.retried = True
                try:
                    self._place(handle, avoid=replica)
                    self.event({"event": "request_retried", "id": handle.request_id, "from": replica.name, "to": handle.replica.name})
                    continue
                except ServeError as refusal:
                    handle.emit(refusal)
                    continue
            handle.emit(Unavailable(f"replica {replica.name} stopped while serving this request ({why}); "
                                    "send it again: the other replicas serve on, and it restarts"))

    def _reserve(self, handle: RemoteHandle, tried: set[str]) -> Replica | None:
        """The ready replica with the fewest requests in flight (the least recently chosen of
        equals), with the request filed there before it is sent (its first events may come
        before the replica's answer); None when every ready one was tried."""
        with self._lock:
            candidates = [r for r in self.replicas if r.ready and r.name not in tried]
            if not candidates:
                return None
            replica = min(candidates, key=lambda r: (len(r.open), r.chosen))
            self._chosen += 1
            replica.chosen, replica.open[handle.key], handle.replica = self._chosen, handle, replica
            return replica

    # ---- operators -------------------------------------------------------------------------------

    def drafts(self) -> list[dict]:
        """Every draft (as the single-process server lists them) with the version each replica
        serves, then the replicas and the learner actors."""
        replicas = replica_states(self.replicas)
        rows = [row for rows in (learner_call(self.learners, "drafts") if self.learners else []) for row in rows]
        for row in rows:
            row["replicas"] = {r["name"]: r.get("versions", {}).get(row["name"]) for r in replicas}
            suffix = {r["name"]: r["suffix_index"][row["name"]] for r in replicas if row["name"] in r.get("suffix_index", {})}
            if suffix:
                row["suffix_index"] = suffix
        baselines = next((r["baselines"] for r in replicas if "baselines" in r), [])
        return rows + baselines

    def replica_rows(self) -> list[dict]:
        return [{k: v for k, v in r.items() if k not in ("baselines", "governance", "suffix_index")} for r in replica_states(self.replicas)]

    def learning(self) -> dict:
        """Whether the learners learn (GET /ready shows it: a learner restarting never makes the
        front unready, its replicas serve on)."""
        replicas = {r.name: r.ready for r in self.replicas}
        try:
            states = learner_call(self.learners, "learning", timeout=5) if self.learners else []
        except Unavailable:
            return {"learning": self.config.learning, "paused": None, "busy": None, "learners": "not answering (restarting?)",
                    "replicas": replicas}
        return {"learning": self.config.learning, "paused": any(s["paused"] for s in states), "busy": any(s["busy"] for s in states),
                "replicas": replicas}

    def governance(self) -> dict:
        """The learner actors' records, with the replicas' suffix indices and opt-outs."""
        total: dict = {}
        for part in learner_call(self.learners, "governance") if self.learners else []:
            for key, value in part.items():
                if key.startswith("suffix_") or key == "refused_opt_out":
                    continue
                total[key] = value if key == "retention_seconds" else total.get(key, 0) + value
        for state in replica_states(self.replicas):
            for key in ("suffix_requests_held", "suffix_tokens_held", "refused_opt_out"):
                total[key] = total.get(key, 0) + state.get("governance", {}).get(key, 0)
        return total

    def routing(self) -> dict:
        return {}

    def operate(self, action: str, name: str | None = None, version: str | None = None) -> dict:
        """As :meth:`ServingCore.operate`, through the learner actors; a rollback or a pin is
        served by every ready replica when this returns."""
        require_learning(self.config)
        if action in ("pause", "resume"):
            learner_call(self.learners, "operate", action)
            result = self.learning()
        else:
            if name is None:
                raise ServeError(f"{action} needs a draft name")
            result = learner_call(self.learners, "operate", action, name, version, group=group_of(name, len(self.learners)))[0]
            if isinstance(result, ServeError):
                raise result
            if action in ("rollback", "pin"):
                ready = [r for r in self.replicas if r.ready]
                served = ray.get([r.actor.follow.remote() for r in ready], timeout=CALL_TIMEOUT)
                result["replicas"] = {r.name: s.get(name) for r, s in zip(ready, served)}
        self.event({"event": "admin", "action": action, "draft": name, "version": version, "result": result})
        return result

    def purge(self, request_id: str | None = None, older_than_days: float | None = None) -> dict:
        before = purge_cutoff(request_id, older_than_days)
        removed = sum(learner_call(self.learners, "purge", request_id, before)) if self.learners else 0
        replicas = [r for r in self.replicas if r.ready]
        if len(replicas) < len(self.replicas):
            raise Unavailable("a replica is restarting: its suffix index could not be purged; retry when all are ready "
                              f"({removed} records were deleted)")
        answers = ray.get([r.actor.purge.remote(request_id, older_than_days) for r in replicas], timeout=CALL_TIMEOUT)
        self.events.drop(request_id, before)
        indexed = sum(a["suffix_requests_deleted"] for a in answers)
        cached = sum(a.get("prefix_cache_cells_deleted", 0) for a in answers)  # issue 49: each replica's prefix cache
        self.event({"event": "purge", "request_id": request_id, "older_than_days": older_than_days, "records": removed,
                    "suffix_requests": indexed})
        return {"records_deleted": removed, "suffix_requests_deleted": indexed, "prefix_cache_cells_deleted": cached,
                "governance": self.governance()}

    def event(self, event: dict) -> None:
        self.events.write(event)

