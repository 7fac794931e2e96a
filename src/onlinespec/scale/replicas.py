"""A serving replica: one whole :class:`~onlinespec.serve.core.ServingCore` in a Ray actor.

Its drafts learn through the learner actors (:class:`~onlinespec.scale.learners.RemoteLearner`):
a request is answered once its records are on the learner actor's disk, and the replica serves
the version its registry's CURRENT names (pushed after each publication, checked every second).
Its event log, lock and suffix indices are its own (``<out-dir>/replicas/<name>/``,
``suffix-index.<name>.safetensors``): a replica's suffix index learns the traffic it served.

``submit`` queues a request; ``events`` is one long stream, per front, of every open request's new
events, batched per engine step; ``cancel`` frees a request whose client went away.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray
import torch

from onlinespec.cpu import PLUMBING_NICE, keep_other_threads_lowered
from onlinespec.online.registry import DraftRegistry
from onlinespec.scale.learners import RemoteLearner, group_of
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore
from onlinespec.serve.handles import Served, ServeError
from onlinespec.serve.logs import LogSettings, configure_logging

ACCEPTED = "accepted"  # submit's answer when the replica queued the request
GATHER_SECONDS = 0.002  # after a wake-up, the events channel waits this long to send one step's events together


class ReplicaService:
    def __init__(self, config: CoreConfig, out_dir: str, replica: str, learners: list, threads: int, plumbing_nice: int = PLUMBING_NICE,
                 logs: LogSettings | None = None) -> None:
        torch.set_num_threads(threads)
        configure_logging(logs)  # request log lines, as the single-process server writes them (--log-level, --log-format)
        self.replica, self.learners = replica, learners
        self._open: dict[str, object] = {}  # the front's key -> the handle of a request this replica serves
        self._wake = asyncio.Event()
        self._stopped = False  # set by shutdown: the events stream ends once it has sent every request's last event
        self._loop: asyncio.AbstractEventLoop | None = None
        self.core = ServingCore(config, out_dir, replica=replica, learners=self._learner if config.learning else None)
        self.core.load()
        if plumbing_nice:  # Ray's threads and ours but the engine's OpenMP team: they only carry messages
            keep_other_threads_lowered(plumbing_nice)
        # model work off the engine thread (loading a published version) runs here, on one torch thread
        self._side = ThreadPoolExecutor(1, thread_name_prefix="onlinespec-follow", initializer=torch.set_num_threads, initargs=(1,))

    def _learner(self, name: str, proposer, origin: dict | None = None) -> RemoteLearner:
        # origin (a draft spawned from another) is content routing's, which runs in one process only
        actor = self.learners[group_of(name, len(self.learners))]
        return RemoteLearner(name, proposer, actor, DraftRegistry(Path(self.core.out_dir) / "drafts" / name), self.core.config.learner,
                             on_event=lambda event: self.core.learner_event({**event, "draft": name}))

    async def ready(self) -> dict:
        core = self.core
        return {"replica": self.replica, "pid": os.getpid(), "status": core.status, "context": core.context,
                "started_at": core.started_at, "node": ray.get_runtime_context().get_node_id()}

    async def submit(self, key: str, request: dict):
        """Queue a request (``key``: the front's name for it); ACCEPTED, or the
        :class:`ServeError` that refused it. Its events go out through :meth:`events`."""
        self._loop = asyncio.get_running_loop()
        try:
            handle = await asyncio.to_thread(self.core.submit, notify=self._notify, **request)
        except ServeError as err:
            return err
        self._open[key] = handle
        self._wake.set()  # what it emitted before it was filed here goes out too
        return ACCEPTED

    def _notify(self) -> None:  # the core's threads, after each event of any request
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is gone (the actor is stopping)
            pass

    async def cancel(self, key: str) -> None:
        """The front's client went away: free the request's slot."""
        handle = self._open.pop(key, None)
        if handle is not None and not handle.done:
            handle.cancel()

    async def events(self):
        """Every open request's new events, as ``[(key, [event, ...]), ...]``: what one engine
        step emitted for all of them goes out as one item (each item is an object-store put and
        a message, about a millisecond here; one per request per step cost streamed requests 10%)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(GATHER_SECONDS)  # the rest of the step's events (the engine emits them in a burst)
            batch = []
            for key, handle in list(self._open.items()):
                events = []
                while not handle.events.empty():
                    events.append(handle.events.get_nowait())
                if events:
                    batch.append((key, events))
                    if isinstance(events[-1], (Served, ServeError)):
                        self._open.pop(key, None)
            if batch:
                yield batch
            if self._stopped and not self._open:
                return  # the front's relay thread ends with it, before the front stops Ray

    async def follow(self) -> dict:
        """Serve every draft's CURRENT now (a publication or a rollback); what each draft serves."""
        await asyncio.get_running_loop().run_in_executor(self._side, self._follow)
        return self.versions()

    def _follow(self) -> None:
        for learner in self.core.pool.learners:
            learner.follow_registry()

    def versions(self) -> dict:
        """The version each draft serves (the registry's CURRENT from its next step on)."""
        return {name: draft.learner.version if draft.learner is not None else draft.version
                for name, draft in self.core.pool.drafts.items()}

    async def state(self) -> dict:
        """What the front's admin API shows of this replica."""
        core = self.core
        suffix = {n: d.suffix.stats() for n, d in core.pool.drafts.items() if d.suffix is not None}
        baselines = [{"name": n, "version": d.version, "learning": False} for n, d in core.baselines.items()]
        return {"replica": self.replica, "pid": os.getpid(), "status": core.status, "versions": self.versions(),
                "suffix_index": suffix, "baselines": baselines, "governance": core.governance(), "served": core.requests_served}

    async def metrics(self) -> str:
        text = self.core.metrics.text()
        return text.decode() if isinstance(text, bytes) else text

    async def purge(self, request_id: str | None, older_than_days: float | None) -> dict:
        return await asyncio.to_thread(self.core.purge, request_id=request_id, older_than_days=older_than_days)

    async def shutdown(self, drain_seconds: float) -> None:
        await asyncio.to_thread(self.core.shutdown, drain_seconds=drain_seconds)
        self._stopped = True
        self._wake.set()


def replica_actor(cpus: float):
    """The Ray actor class of :class:`ReplicaService`: restarted by Ray when its process dies
    (it serves CURRENT again); its requests in flight then fail, and are never retried by Ray (the
    front decides: a request that sent nothing yet goes to another replica)."""
    return ray.remote(max_restarts=-1, max_task_retries=0, num_cpus=cpus)(ReplicaService)
