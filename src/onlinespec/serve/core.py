"""The serving core: one target, its drafts, one engine loop and the online learners.

Everything that serves goes through :class:`ServingCore`: the HTTP server
(:mod:`onlinespec.serve.app`), ``onlinespec online`` (a stream submitted in process) and the
demo (a stream sent over HTTP). None keeps a loop of its own. What it answers is declared once,
:class:`onlinespec.serve.interface.Core`; the parts it runs (target, engine, router, drafts,
baselines, recorder) are built from its ``CoreConfig`` by :mod:`onlinespec.serve.builder`; the
admin API's queries and actions are :class:`onlinespec.serve.operations.PoolOperations`.

Threads::

    callers (any thread)  submit / cancel / admin   -->  scheduler queue (checks: admission.py)
    engine loop (one)     admit, engine.step, push each request's new text to its handle; a published
                          draft is swapped in between two steps; learning's turns (learning.py)
    writer (one)          finished request -> its draft's durable replay buffer -> the handle
                          completes: a client never sees an answer whose record is not on disk (writer.py)
    housekeeping (one)    retention; a CURRENT another process changed (operations.py)
    learners (pool)       background updates (arXiv 2310.07177, section 4.2), gate, registry

Callers get back handles, events and errors (:mod:`onlinespec.serve.handles`).

A failure inside a step fails the requests of that step with a clear error, resets the batch
cache and the loop goes on; an update that fails publishes nothing. Neither stops the service.

One thread runs the model: the engine loop also loads the target and measures its cost curve,
and every other thread that touches a tensor runs one torch thread. With OpenMP, each thread that
ever ran a parallel op keeps a team of workers for life; once the process holds more workers than
cores, every team's workers stop spinning between ops and the engine's forwards ran 1.7x slower
here (a calibration left on the main thread was enough).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from onlinespec.cpu import ENGINE_THREAD, name_thread
from onlinespec.decoding.request import RequestState
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import text_delta
from onlinespec.decoding.stopping import StopChecker
from onlinespec.models import LoadedModel
from onlinespec.online.pool import ServedDraft
from onlinespec.serve.admission import Domains, admit_budget, check_room, encode, named_draft
from onlinespec.serve.builder import CoreHooks, build, load_configured_target
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import Delta, Failed, Handle, LoadFailed, ServeError, Timeout, Unavailable
from onlinespec.serve.interface import Core
from onlinespec.serve.learning import LearningShare
from onlinespec.serve.metrics import ServeMetrics, batch_state
from onlinespec.serve.operations import PoolOperations, housekeep
from onlinespec.storage import EventLog, OutDirLock, kill_point
from onlinespec.tokens import Prompt

_request_ids = itertools.count()


class ServingCore(PoolOperations, Core):
    """One process's serving core (:class:`~onlinespec.serve.interface.Core`): the engine loop and
    the lifecycle of the requests it serves. Its parts are built from the config by
    :mod:`onlinespec.serve.builder`; the admin API's half is :class:`~onlinespec.serve.operations.PoolOperations`."""

    def __init__(self, config: CoreConfig, out_dir: str | Path, on_event: Callable[[dict], None] | None = None,
                 target: LoadedModel | None = None, replica: str | None = None,
                 learners: Callable[[str, object], object] | None = None) -> None:
        """``on_event`` receives every event (requests, drafts, updates) as a dict, from the core's
        threads; the core also appends them to ``out_dir/events.jsonl``. ``target``: an already
        loaded target to share (else :meth:`load` loads ``config.target``).

        ``replica``: this core is one of several serving replicas of ``out_dir``
        (:mod:`onlinespec.scale`): its event log, lock and suffix indices are its own
        (``out_dir/replicas/<replica>/``, ``suffix-index.<replica>.safetensors``), the drafts'
        registries are shared, and ``learners(name, proposer)`` gives each draft its learner
        (a client of the learner actor that owns the buffer)."""
        self.config, self.out_dir, self.replica, self._learners = config, Path(out_dir), replica, learners
        if replica is not None and config.router == "content":
            raise ValueError("content routing runs in a single process: serve replicas with --router domain or single")
        if replica is not None and config.fresh_baseline:
            raise ValueError("the fresh baseline learns in the serving process: serve it without --replicas")
        self.own_dir = self.out_dir if replica is None else self.out_dir / "replicas" / replica  # its lock and event log
        self.lock = OutDirLock(self.own_dir).acquire()  # OutDirBusy if another process serves from it
        try:
            self.events = EventLog(self.own_dir / "events.jsonl", config.retention_seconds)  # lines past retention go now
        except BaseException:
            self.lock.release()
            raise
        self.metrics = ServeMetrics(config.model_name)
        self.target = target
        self.tokenizer, self.context = None, None  # the target's, once loaded
        self.status = "starting"  # starting -> loading -> calibrating -> ready -> draining -> stopped
        self.error: str | None = None
        self._on_event = on_event
        self._lock = threading.Lock()
        self._wake = threading.Condition()
        self.share: LearningShare | None = None  # set once loaded, when learning takes the engine's turns
        self.recorder: RecordWriter | None = None  # set once loaded
        self._handles: dict[int, Handle] = {}
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (fn, future) to run on the engine thread
        self._routes: dict[str, ServedDraft] = {}  # domain -> its draft, once routed
        self._domains = Domains(config.max_domains)
        self._stopping = False
        self.started_at = time.time()

    @property
    def requests_served(self) -> int:
        """Requests answered so far (the event log's learning lines carry it; a Ray replica reports it)."""
        return self.recorder.served if self.recorder is not None else 0

    # ---- start and stop ---------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def load(self) -> None:
        """Load the target and the drafts, measure the cost curve, start serving: on the engine
        thread, blocking until done (seconds to a minute). The server calls it in the background
        and answers /ready when it returns."""
        loaded = threading.Event()
        self._loop_thread = threading.Thread(target=self._run, args=(loaded,), name="onlinespec-engine", daemon=True)
        self._loop_thread.start()
        loaded.wait()
        if self.status == "failed":
            raise LoadFailed(f"the serving core failed to load: {self.error}")

    def _run(self, loaded: threading.Event) -> None:
        name_thread(ENGINE_THREAD)  # and its OpenMP team, started from it: what a Ray replica keeps at full priority
        try:
            self._load()
        except Exception as err:
            self.status, self.error = "failed", f"{type(err).__name__}: {err}"
            self.event({"event": "load_failed", "error": self.error})
            return
        finally:
            loaded.set()
        try:
            self._loop()
        except Exception as err:  # outside a step's own guard (a bug): say so and fail what waits, never hang
            logging.getLogger("onlinespec.serve").exception("the engine loop stopped")
            self.status, self.error = "failed", f"the engine loop stopped: {type(err).__name__}: {err}"
            self.event({"event": "engine_failed", "error": self.error})
            for handle in list(self._handles.values()):
                self._fail(handle, Failed(f"the server failed ({self.error}); it answers no more requests until restarted"))

    def _load(self) -> None:
        """Build the parts (:mod:`onlinespec.serve.builder`), open the pool, start the recorder and
        housekeeping: on the engine thread."""
        self.status = "loading"
        if self.target is None:
            self.target = load_configured_target(self.config)
        self.status = "calibrating"
        hooks = CoreHooks(self.event, self.learner_event, self._event_served, self._notify_engine, self._release)
        parts = build(self.config, self.target, self.out_dir, self.metrics, hooks, self.replica, self._learners)
        self.tokenizer, self.eos, self.engine, self.scheduler = parts.tokenizer, parts.eos, parts.engine, parts.scheduler
        self.context, self.identity, self.share, self.pool, self.baselines = parts.engine.context, parts.identity, parts.share, parts.pool, parts.baselines
        parts.open(self.event)  # its events reach learner_event, which reads self.pool
        self.recorder = parts.recorder
        self.recorder.start()
        self._housekeeper = threading.Thread(target=housekeep, args=(self.pool, self.metrics, lambda: self._stopping),
                                             name="onlinespec-housekeeping", daemon=True)
        self._housekeeper.start()
        self.status = "ready"

    def shutdown(self, drain_seconds: float = 30.0) -> None:
        """Refuse new requests, let those in flight finish (at most ``drain_seconds``, then they
        fail), write every finished request's records, abandon an update in flight without
        publishing, and stop the threads."""
        if self.status in ("loading", "calibrating"):  # stopped while loading: the loop ends once loaded
            self._stopping = True
            self._loop_thread.join(300)
        if self.status != "ready":
            self.status = "stopped"
            self.events.close()
            self.lock.release()
            return
        self.status, self._stopping = "draining", True
        deadline = time.monotonic() + drain_seconds
        while self._handles and time.monotonic() < deadline:
            time.sleep(0.02)
        for handle in list(self._handles.values()):
            self._fail(handle, Unavailable("the server is shutting down: the request was not finished; send it again"))
        with self._wake:
            self._wake.notify_all()
        self._loop_thread.join(60)
        if self.share is not None:
            self.share.close()
        while not self._calls.empty():  # calls that came too late for the engine thread
            self._calls.get_nowait()[1].set_exception(Unavailable("the server is shutting down"))
        self.recorder.stop()
        self._housekeeper.join(60)
        self.pool.close()
        for learner in self.pool.learners:
            learner.stop(timeout=60)
        self.event({"event": "stop", "requests_served": self.requests_served, "governance": self.pool.governance()})
        self.status = "stopped"
        self.events.close()
        self.lock.release()

    # ---- requests --------------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, domain: str = "default", train: bool = True,
               draft: str | None = None, request_id: str | None = None,
               notify: Callable[[], None] | None = None, stream: bool = False, tenant: str = "", cache_salt: str | None = None,
               priority: int = 0) -> Handle:
        """Queue a request; its :class:`Handle` streams its text and ends with a :class:`Served`.

        ``params.max_new_tokens`` is the request's budget (its ``max_tokens``): checked against
        the context left; None (and no ``params``) gives ``default_max_tokens`` within the
        context, or all the context left (:func:`~onlinespec.serve.admission.admit_budget`).
        ``draft``: serve with this draft by name (``"static"``: the
        starting draft kept static, when offered; ``"none"``: the target alone; a pool draft's
        name) instead of the router's choice; such requests train nothing unless the draft is
        the router's own. ``train=False``: never stored, never trained on. ``stream``: the
        handle gets the new text after every step (decoding it costs the engine thread time,
        so only streams ask for it). ``tenant``: who sent it (the API key's or a header's name,
        :mod:`onlinespec.serve.app`); its suffix-index lookups see that tenant's earlier requests
        only, unless the server shares the index (``CoreConfig.shared_suffix``). ``cache_salt``
        (vLLM's): the prefix cache reuses only cells of requests of the same tenant and salt.
        ``priority``: lower first within the tenant (docs/serve.md, "Scheduling").
        """
        if not self.ready:
            reason = self.error or ("the server is shutting down" if self.status in ("draining", "stopped") else f"the model is {self.status}")
            raise Unavailable(f"not ready: {reason}; retry when GET /ready answers 200")
        vocab = min(self.engine.runner.vocab_size, len(self.tokenizer))
        ids = encode(self.tokenizer, vocab, prompt)
        params = params or SamplingParams(max_new_tokens=None)
        budget = admit_budget(self.engine, params, len(ids), self.config.default_max_tokens, vocab)
        request_id = request_id or f"req-{next(_request_ids)}-{int(self.started_at)}"
        group = (tenant, request_id)  # issue 46: one request's choices; the queue's room, then the domain's slot (every check passed)
        check_room(self.scheduler, self.config, tenant, group, self.recorder.recent_seconds, self.metrics.failures)
        domain = self._domains.admit(domain, tenant)
        by_content = draft is None and self.pool.content is not None
        chosen = (self.pool.content.provisional(load=False) or self.on_engine(self.pool.content.provisional)) if by_content else self._draft(domain, draft)
        train = train and (chosen.learner is not None or chosen.suffix is not None)
        headroom = self.share.turns.headroom() if self.share is not None else 1.0  # the share of serving time a draft could pay in
        with self._lock:
            check_room(self.scheduler, self.config, tenant, group, self.recorder.recent_seconds, self.metrics.failures)
            state = RequestState(ids, params, StopChecker(params, self.eos, self.tokenizer, max_new_tokens=budget), proposer=chosen.proposer,
                                 adaptive=chosen.adaptive, trace=[] if train and chosen.learner is not None and chosen.learner.records_next(headroom) else None,
                                 embed=by_content, tenant="" if self.config.shared_suffix else tenant)
            state.cache_key, state.cache_owner = (tenant, cache_salt or ""), request_id  # the prefix cache: its key and purge owner
            handle = Handle(self.cancel, state, chosen, domain, train, request_id, time.perf_counter() + self.config.request_timeout,
                            notify, prompt if self.config.log_text else "", stream)
            self._handles[state.id] = handle
            self.scheduler.submit(state, tenant=tenant, group=group, priority=priority)  # issue 46: fair share
        self._notify_engine()
        return handle

    def on_engine(self, fn: Callable):
        """Run ``fn`` on the engine thread between two steps and return its result (model work:
        a new draft's weights, a rollback's), so that one thread runs the model."""
        if threading.current_thread() is self._loop_thread:
            return fn()
        future: Future = Future()
        self._calls.put((fn, future))
        self._notify_engine()
        return future.result()

    def _run_calls(self) -> None:
        while not self._calls.empty():
            fn, future = self._calls.get_nowait()
            try:
                future.set_result(fn())
            except BaseException as err:
                future.set_exception(err)

    def _draft(self, domain: str, name: str | None) -> ServedDraft:
        if name is not None:
            return named_draft(name, self.pool.drafts, self.baselines)
        draft = self._routes.get(domain)  # a domain keeps its draft once routed: only a new one waits for the engine thread
        if draft is None:
            draft = self._routes[domain] = self.on_engine(lambda: self.pool.route(domain))
        return draft

    def cancel(self, handle: Handle) -> None:
        if self._drop(handle, "cancelled"):
            self.event({"event": "cancelled", "id": handle.request_id, "draft": handle.draft.name,
                        "new_tokens": len(handle.state.stop.generated)})

    def _fail(self, handle: Handle, error: ServeError) -> None:
        if self._drop(handle, error.kind):
            self.event({"event": "failed", "id": handle.request_id, "draft": handle.draft.name, "error": error.message})
            handle.emit(error)

    def _drop(self, handle: Handle, why: str) -> bool:
        """Take an unfinished request out of the engine (its slot frees at the next step); False
        when it had already left (finished, cancelled or failed on another thread)."""
        with self._lock:
            if self._handles.pop(handle.state.id, None) is None:
                return False
        self.scheduler.cancel(handle.state)
        self._release(handle)
        self.metrics.batch(*batch_state(self.scheduler))  # no step may come to update it
        self.metrics.failures.labels(why).inc()
        return True

    # ---- the engine loop (one thread) ----------------------------------------------------------

    def _notify_engine(self) -> None:
        with self._wake:
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while (not self.scheduler.has_work and not self._stopping and self._calls.empty()
                       and not (self.share is not None and self.share.wanted())):
                    self._wake.wait(0.25)
                    self._expire()
            self._run_calls()
            if self._stopping and not self.scheduler.has_work:
                return
            if not self.scheduler.has_work:
                if self.share is not None:
                    self.share.give(idle=True)
                continue
            self._expire()
            tick = time.perf_counter()
            try:
                advanced, report = self.scheduler.step()
            except Exception as err:  # two failed steps in a row (Scheduler.step): fail their requests, never the service
                logging.getLogger("onlinespec.serve").exception("a step failed")
                self._reset(f"{type(err).__name__}: {err}")
                continue
            if self.share is not None:
                self.share.stepped(time.perf_counter() - tick, report.batch if report is not None else 0)
            kill_point("serve.step")
            self.metrics.batch(*batch_state(self.scheduler))
            now = time.perf_counter()
            for state in advanced:
                self._advance(state, now)

    def _advance(self, state: RequestState, now: float) -> None:
        handle = self._handles.get(state.id)
        if handle is None:  # cancelled while its step ran
            return
        if state.error is not None:  # failed alone in the engine (SpeculativeEngine.step)
            self._fail(handle, Failed(f"the engine could not serve this request ({state.error}); the requests beside it went on"))
            return
        if not handle.routed and (state.prompt_embedding is not None or state.finished):
            try:
                self._route(handle)
            except Exception:  # routing is advice: the request goes on with the draft it started with
                logging.getLogger("onlinespec.serve").exception("routing request %s by content failed", handle.request_id)
        version = handle.draft.version
        if version and (not handle.versions or handle.versions[-1] != version):
            handle.versions.append(version)
        if state.new_tokens:
            if handle.last_emit is not None:  # the first tokens are time to first token, not inter-token
                for _ in state.new_tokens:
                    self.metrics.inter_token((now - handle.last_emit) / len(state.new_tokens))
            handle.last_emit = now
        if handle.stream and (state.new_tokens or state.finished):
            delta, handle.emitted = text_delta(state, handle.emitted)
            handle.emit(Delta(delta, list(state.new_tokens), state.logprobs[len(state.logprobs) - len(state.new_tokens):] or None))
        if state.finished:
            with self._lock:
                self._handles.pop(state.id, None)
            self.recorder.put(handle)

    def _route(self, handle: Handle) -> None:
        """Content routing, once the prompt is prefilled (engine thread, between two steps): the
        request's cluster; its cluster's draft records it; the best-scoring draft drafts for it
        from the next round on (a head drafted nothing in the first: it had no target feature)."""
        handle.routed = True
        state = handle.state
        if state.prompt_embedding is None:  # a model without hidden states to read, or nothing left to serve
            return
        route = self.pool.content.route(state.prompt_embedding, handle.domain, handle.request_id)
        state.prompt_embedding = None
        with self._lock:  # cancelled (or failed) meanwhile, on another thread: give the drafts back now
            if state.id not in self._handles:
                self.pool.content.release(route)
                return
            handle.route, handle.home, handle.draft = route, route.home, route.serve
        if route.serve.proposer is not state.proposer:
            # a head's state is the target's feature, whoever drafts; a draft LM's is its own cache: start afresh
            keep = type(route.serve.proposer) is type(state.proposer) and state.proposer.uses_features
            state.proposer, state.adaptive = route.serve.proposer, route.serve.adaptive
            if not keep:
                state.draft_state = state.proposer.start(state.prompt_ids)

    def _release(self, handle: Handle) -> None:
        if handle.route is not None:
            self.pool.content.release(handle.route)
            handle.route = None

    def _expire(self) -> None:
        now = time.perf_counter()
        for handle in [h for h in list(self._handles.values()) if h.deadline < now]:
            self._fail(handle, Timeout(f"the request ran past the server's limit of {self.config.request_timeout:g} s "
                                       f"({len(handle.state.stop.generated)} tokens generated); ask for fewer tokens or retry"))

    def _reset(self, error: str) -> None:
        """After a failed step: fail its requests, start a fresh batch cache."""
        for state in list(self.scheduler.running):
            handle = self._handles.get(state.id)
            if handle is not None:
                self._fail(handle, Failed(f"the engine failed while serving this request ({error}); send it again"))
        self.engine.reset()

    # ---- events and operators ---------------------------------------------------------------------

    def event(self, event: dict) -> None:
        event = self.events.write(event)  # a full disk: the log loses lines, serving goes on
        if self._on_event is not None:
            self._on_event(event)

    def learner_event(self, event: dict) -> None:
        """A learner's event (an update, a failure, a version): on /metrics, in the event log, and
        to the learning controller."""
        self.metrics.learner(event)
        if self.pool.content is not None:
            self.metrics.routing(event, self.pool)
        self._event_served(event)
        if self.share is not None:
            self.share.learner_event(event)

    def _event_served(self, event: dict) -> None:
        """A learning event, with the number of requests served before it."""
        self.event({**event, "requests_served": self.requests_served})
