# Over 500 lines: the serving core's threads, handles, errors and events together; carving it (serve/handles.py, routing/) is issue 29.
"""The serving core: one target, its drafts, one engine loop and the online learners.

Everything that serves goes through :class:`ServingCore`: the HTTP server
(:mod:`onlinespec.serve.app`), ``onlinespec online`` (a stream submitted in process) and the
demo (a stream sent over HTTP). None keeps a loop of its own.

Threads::

    callers (any thread)  submit / cancel / admin   -->  scheduler queue
    engine loop (one)     admit, engine.step, push each request's new text to its handle;
                          a published draft is swapped in between two steps
    recorder (one)        finished request -> its draft's durable replay buffer -> the handle
                          completes: a client never sees an answer whose record is not on disk
    learners (pool)       background updates (arXiv 2310.07177, section 4.2), gate, registry

A failure inside a step fails the requests of that step with a clear error, resets the batch
cache and the loop goes on; an update that fails publishes nothing. Neither stops the service.

One thread runs the model: the engine loop also loads the target and measures its cost curve,
and every other thread that touches a tensor runs one torch thread. With OpenMP, each thread that
ever ran a parallel op keeps a team of workers for life; once the process holds more workers than
cores, every team's workers stop spinning between ops and the engine's forwards ran 1.7x slower
here (a calibration left on the main thread was enough).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from onlinespec.factory import DEFAULT_DRAFT, DEFAULT_DTYPE, DEFAULT_K, engine_options, make_proposer
from onlinespec.cpu import ENGINE_THREAD, name_thread
from onlinespec.decoding.engine import DEFAULT_PREFILL_CHUNK, SpeculativeEngine
from onlinespec.decoding.request import Generation, RequestState, RequestStats
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.scheduler import Scheduler
from onlinespec.decoding.speculative import text_delta
from onlinespec.decoding.stopping import StopChecker
from onlinespec.metrics import speculative_decoding
from onlinespec.models import LoadedModel, load_target
from onlinespec.online.controller import LearnController
from onlinespec.online.learner import LearnerConfig
from onlinespec.routing.content import ContentConfig
from onlinespec.online.pool import SUFFIX_FILE, Draft, DraftPool, Route, learner_row, replica_suffix_file, saved_drafts
from onlinespec.storage import EventLog, OutDirLock, kill_point
from onlinespec.online.turns import EngineTurns
from onlinespec.routing.domains import MAX_DRAFTS, RESERVED, ROUTERS, Router
from onlinespec.safety import check_label, shown
from onlinespec.serve.metrics import ServeMetrics
from onlinespec.tokens import Prompt, encode_prompt, eos_token_ids, tokenizer_fingerprint

log = logging.getLogger("onlinespec.requests")

STATIC, TARGET_ALONE = RESERVED  # drafts a request may ask for by name, never trained on
TICK_SECONDS = 1.0  # housekeeping (retention, another process's rollback) at least this often


@dataclass
class CoreConfig:
    target: str = "default"
    draft: str = DEFAULT_DRAFT
    k: int = DEFAULT_K
    dtype: str = DEFAULT_DTYPE
    backend: str = "auto"  # what runs the target: llama.cpp for a GGUF file on a CPU, else torch (onlinespec.backends)
    device: str = "auto"  # torch backend: cuda when torch sees one, else cpu
    learn: bool = True  # the drafts learn online (off: serve them static, suffix index included)
    head_updates: bool = True  # learning trains the learned draft too (off: only the suffix index learns)
    buffer_policy: str = "window"
    buffer_records: int = 2000
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    router: str = "domain"  # domain: one draft per request domain; single: one shared draft; content: by prompt clusters
    max_drafts: int = MAX_DRAFTS  # domain: domains beyond this many share one draft; content: drafts kept in memory
    content: ContentConfig = field(default_factory=ContentConfig)  # the content router's clusters and detectors
    adaptive_k: bool = True  # per-step k from the measured cost curve (off: always k proposals)
    kernels: bool = True  # small-batch linear kernels when they measure faster
    max_batch: int = 8  # requests verified per step
    max_waiting: int = 64  # requests queued for a slot; beyond this a request is refused (retry later)
    max_domains: int = 64  # distinct request domains (metrics labels, routes); a new one beyond this is refused
    shared_suffix: bool = False  # one suffix index per draft for every tenant (each tenant's proposals then reveal others' text)
    speculation_details: bool = False  # responses carry per-position and per-drafter acceptance (a side channel: off by default)
    default_max_tokens: int = 256  # when a request gives no max_tokens (capped by the context left)
    request_timeout: float = 600.0  # seconds from arrival; a request still running then fails
    static_baseline: bool = False  # also serve the starting draft kept static, as draft "static"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    log_text: bool = False  # request log lines carry prompt and output text
    retention_days: float | None = None  # records (and event-log lines) older than this are deleted; None: kept
    max_buffer_bytes: int = 512 * 2**20  # the most bytes a draft's replay buffer keeps (oldest out first)
    suffix_tokens: int = 500_000  # the most tokens a draft's suffix index of earlier requests keeps (0: it learns nothing)
    learn_share: float | None = 0.1  # under load, the most of the engine's wall time updates take (in its turns,
    # onlinespec.online.turns; idle: all of it); None: updates run beside serving in a thread at low priority

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}: use one of {ROUTERS}")
        if self.k < 0 or self.max_batch < 1 or self.max_waiting < 0 or self.default_max_tokens < 1 or self.max_domains < 1:
            raise ValueError("k >= 0, max_batch >= 1, max_waiting >= 0, default_max_tokens >= 1 and max_domains >= 1 are required")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.retention_days is not None and not self.retention_days > 0:
            raise ValueError(f"retention_days must be > 0 (or unset: keep records), got {self.retention_days}")
        if self.max_buffer_bytes < 1:
            raise ValueError(f"max_buffer_bytes must be >= 1, got {self.max_buffer_bytes}")
        if self.suffix_tokens < 0:
            raise ValueError(f"suffix_tokens must be >= 0 (0: the suffix index learns nothing), got {self.suffix_tokens}")
        if self.learn_share is not None and not 0.0 < self.learn_share <= 1.0:
            raise ValueError(f"learn_share must lie in (0, 1] (or unset: updates in a low-priority thread), got {self.learn_share}")

    @property
    def retention_seconds(self) -> float | None:
        return None if self.retention_days is None else self.retention_days * 86400.0

    @property
    def learning(self) -> bool:
        return self.learn and self.draft != "none"


class ServeError(Exception):
    """A request the core refuses or could not finish; ``status`` is the HTTP status it maps to."""

    status, kind = 400, "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def __reduce__(self):  # crosses processes whole (a Ray replica's errors reach the HTTP front as they are)
        return _rebuild_error, (type(self), self.message, dict(self.__dict__))


def _rebuild_error(kind: type, message: str, attributes: dict) -> ServeError:
    error = Exception.__new__(kind)
    Exception.__init__(error, message)
    error.__dict__.update(attributes)
    return error


class Overloaded(ServeError):
    status, kind = 429, "rate_limit_error"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, code="queue_full")
        self.retry_after = retry_after


class Unavailable(ServeError):
    status, kind = 503, "service_unavailable"


class NotFound(ServeError):
    status, kind = 404, "not_found_error"


class Timeout(ServeError):
    status, kind = 504, "timeout"


class Failed(ServeError):
    status, kind = 500, "internal_error"


class LoadFailed(RuntimeError):
    """The core could not start (a bad model spec, another model's drafts in the out-dir, ...)."""


@dataclass
class Served:
    """A finished request, as every client reports it."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # stop (EOS or a stop string) | length
    stats: RequestStats
    draft: str
    draft_version: str | None  # the version that served its last step
    draft_versions: list[str]  # every version that served a step (a swap can land mid-request)
    domain: str
    learner_busy: bool
    recorded: bool  # its training records are in the durable buffer
    cluster: int | None = None  # content routing: the cluster it was served as
    home: str | None = None  # content routing: the draft that learnt from it
    replica: str | None = None  # the serving replica (onlinespec.scale), when there are several
    details: bool = False  # metrics name which drafter proposed what (CoreConfig.speculation_details)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def metrics(self) -> dict:
        """A response's ``metrics``: the request's speculation figures in vLLM's per-request shape
        with the draft and version that served it, and its timings."""
        spec = {**speculative_decoding(self.stats), "draft": self.draft, "draft_version": self.draft_version,
                "draft_versions": self.draft_versions}
        if not self.details:  # which tokens the suffix index proposed says what earlier requests held
            spec.pop("by_source")
        routing = {"cluster": self.cluster, "learning_draft": self.home} if self.cluster is not None else {}
        if self.replica is not None:
            routing["replica"] = self.replica
        return {"speculative_decoding": spec, "domain": self.domain, "learner_busy": self.learner_busy, **routing,
                "queued_seconds": self.stats.queued_seconds, "time_to_first_token_seconds": self.stats.first_token_seconds,
                "seconds": self.stats.seconds}


@dataclass
class Delta:
    text: str
    token_ids: list[int]


_request_ids = itertools.count()


class Events:
    """A submitted request's events, in order: with ``stream``, a :class:`Delta` per step; then a
    :class:`Served` or a :class:`ServeError`. ``notify`` is called from the producing thread after
    each event (an asyncio server passes ``loop.call_soon_threadsafe``-based wake-ups)."""

    def __init__(self, notify: Callable[[], None] | None = None) -> None:
        self.notify = notify
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.done = False

    def emit(self, event) -> None:
        if isinstance(event, (Served, ServeError)):
            self.done = True
        self.events.put(event)
        if self.notify is not None:
            self.notify()

    def __iter__(self):
        """Block on each event until the last (for threads; an async server drains ``events``)."""
        while True:
            event = self.events.get()
            yield event
            if isinstance(event, (Served, ServeError)):
                return

    def result(self) -> Served:
        """Block until the request ends; raise its error if it failed."""
        for event in self:
            if isinstance(event, ServeError):
                raise event
            if isinstance(event, Served):
                return event
        raise AssertionError("unreachable")

    def cancel(self) -> None:
        raise NotImplementedError


class Handle(Events):
    """A request submitted to this process's core."""

    def __init__(self, core: ServingCore, state: RequestState, draft: Draft, domain: str, train: bool, request_id: str,
                 deadline: float, notify: Callable[[], None] | None = None, prompt_text: str = "", stream: bool = False) -> None:
        super().__init__(notify)
        self.core, self.state, self.draft, self.domain, self.train = core, state, draft, domain, train
        self.request_id, self.deadline, self.prompt_text = request_id, deadline, prompt_text
        self.stream = stream  # send a Delta after every step (else only the end)
        self.home = draft  # the draft that records it (content routing: its cluster's, which may not serve it)
        self.route: Route | None = None  # content routing, once its prompt is prefilled
        self.routed = not state.embed  # content routing waits for the prompt's embedding
        self.emitted = ""  # text sent so far
        self.last_emit: float | None = None  # when the last tokens went out (inter-token latency)
        self.versions: list[str] = []

    def cancel(self) -> None:
        """The client went away: free the request's slot at the next step (nothing recorded)."""
        self.core.cancel(self)


class ServingCore:
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
        self.own_dir = self.out_dir if replica is None else self.out_dir / "replicas" / replica  # its lock and event log
        self.lock = OutDirLock(self.own_dir).acquire()  # OutDirBusy if another process serves from it
        try:
            self.events = EventLog(self.own_dir / "events.jsonl", config.retention_seconds)  # lines past retention go now
        except BaseException:
            self.lock.release()
            raise
        self.metrics = ServeMetrics()
        self.target = target
        self.status = "starting"  # starting -> loading -> calibrating -> ready -> draining -> stopped
        self.error: str | None = None
        self._on_event = on_event
        self._lock = threading.Lock()
        self._wake = threading.Condition()
        self.turns: EngineTurns | None = None  # set once loaded (learning in the engine's turns)
        self.controller: LearnController | None = None
        self._handles: dict[int, Handle] = {}
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (fn, future) to run on the engine thread
        self._routes: dict[str, Draft] = {}  # domain -> its draft, once routed
        self._domains: set[str] = {"default"}  # every domain a request has named (at most config.max_domains)
        self._stopping = False
        self._served = 0
        self._recent_seconds = 1.0  # moving average of request seconds (Retry-After)
        self.started_at = time.time()

    @property
    def event_write_failures(self) -> int:
        return self.events.failures

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
        self._loop()

    def _load(self) -> None:
        config = self.config
        self.status = "loading"
        if self.target is None:
            self.target = load_target(config.target, config.dtype, config.backend, config.device)
        model, tokenizer = self.target.model, self.target.tokenizer
        self.tokenizer, self.eos = tokenizer, eos_token_ids(model, tokenizer)
        self.status = "calibrating"
        speculative = config.draft != "none"
        options = engine_options(self.target, config.k, adaptive=config.adaptive_k, kernels=config.kernels,
                                 max_batch=config.max_batch) if speculative else {}
        adaptive = options.get("adaptive_k")

        def new_draft():
            """A fresh starting draft with acceptance statistics of its own."""
            return make_proposer(config.draft, self.target, config.dtype).proposer, copy.deepcopy(adaptive)

        runner = self.target.runner(config.max_batch, options.get("cost_curve"), options.get("pad", False))
        self.engine = SpeculativeEngine(runner, self.eos, config.k if speculative else 0, prefill_chunk=config.prefill_chunk)
        self.context = self.engine.context
        self.scheduler = Scheduler(self.engine, config.max_batch)
        learning = config.learning
        content = config.router == "content" and learning and config.head_updates
        router = Router(config.router if learning and (content or config.router != "content") else "single", config.max_drafts,
                        saved_drafts(self.out_dir) if learning else ())
        self.identity = {"target": config.target, "draft": config.draft, "tokenizer": tokenizer_fingerprint(tokenizer)}
        self.turns = None if self.replica or not learning or config.learn_share is None else \
            EngineTurns(config.learn_share, on_wanted=self._notify_engine)  # a Ray replica's learners are actors
        self.controller = LearnController(config.learn_share) if self.turns is not None else None  # learn when it pays
        if self.turns is not None:
            self.metrics.learn_share_limit.set(config.learn_share)
        self.pool = DraftPool(new_draft, self.out_dir, router, config.learner if learning and config.head_updates else None, config.buffer_policy,
                              config.buffer_records, on_event=self._learner_event, buffer_bytes=config.max_buffer_bytes,
                              retention_seconds=config.retention_seconds, identity=self.identity,
                              suffix_tokens=config.suffix_tokens if learning else 0,
                              content=config.content if content else None, max_in_memory=config.max_drafts,
                              learners=self._learners, suffix_file=replica_suffix_file(self.replica) if self.replica else SUFFIX_FILE,
                              keeps_buffers=not self.replica, turns=self.turns)
        self.baselines = {TARGET_ALONE: Draft(TARGET_ALONE, None, None, None)}
        if content:  # the content router's floor is servable by name too
            self.baselines[STATIC] = self.pool.static
        elif config.static_baseline and speculative:
            self.baselines[STATIC] = Draft(STATIC, *new_draft(), None)
        curve = options.get("cost_curve")
        self.event({"event": "start", "router": router.policy, "learn": learning, "draft": config.draft,
                    "max_batch": config.max_batch, "backend": self.target.backend, "device": str(self.target.device),
                    "context": self.context,
                    "cost_curve_ms": curve.milliseconds() if curve else None})
        self.pool.open_saved()  # a previous run's drafts: refused now, at start-up, if they are another model's
        self._recorder_thread = threading.Thread(target=self._record_loop, name="onlinespec-recorder", daemon=True)
        self._recorder_thread.start()
        self._housekeeper = threading.Thread(target=self._housekeeping, name="onlinespec-housekeeping", daemon=True)
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
        if self.turns is not None:  # no engine gives turns any more: an update still running ends (cancelled) freely
            self.turns.close()
        while not self._calls.empty():  # calls that came too late for the engine thread
            self._calls.get_nowait()[1].set_exception(Unavailable("the server is shutting down"))
        self._finished.put(None)
        self._recorder_thread.join(60)
        self._housekeeper.join(60)
        self.pool.stop_scoring()
        self.pool.save_suffix(force=True)
        self.pool.save_routing(force=True)
        for learner in self.pool.learners:
            learner.stop(timeout=60)
        self.event({"event": "stop", "requests_served": self._served, "governance": self.pool.governance()})
        self.status = "stopped"
        self.events.close()
        self.lock.release()

    # ---- requests --------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        try:
            return encode_prompt(self.tokenizer, prompt, min(self.engine.runner.vocab_size, len(self.tokenizer)))
        except (ValueError, TypeError) as err:
            chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
            raise ServeError(str(err), param="messages" if chat else "prompt") from None
        except Exception as err:  # a chat template that rejects the conversation (e.g. role order)
            raise ServeError(f"the chat template could not render these messages: {err}", param="messages") from None

    def max_new_tokens(self, prompt_tokens: int, requested: int | None) -> int:
        """The request's budget: what it asked, or the default, within the context left; a prompt
        that leaves no room, or a request for more than is left, is a clear error."""
        room = self.engine.room(prompt_tokens)
        if room < 1:
            raise ServeError(f"the prompt has {prompt_tokens} tokens: the model's context is {self.context} tokens, "
                             f"so a prompt may have at most {self.context - self.engine.k - 2}", param="messages", code="context_length_exceeded")
        if requested is None:
            return min(room, self.config.default_max_tokens)
        try:
            self.engine.check_fits(prompt_tokens, requested, "max_tokens")
        except ValueError as err:
            raise ServeError(str(err), param="max_tokens", code="context_length_exceeded") from None
        return requested

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        domain: str = "default",
        train: bool = True,
        draft: str | None = None,
        request_id: str | None = None,
        max_tokens: int | None = None,
        notify: Callable[[], None] | None = None,
        stream: bool = False,
        tenant: str = "",
    ) -> Handle:
        """Queue a request; its :class:`Handle` streams its text and ends with a :class:`Served`.

        ``max_tokens`` is the request's budget, as in the OpenAI API (``params.max_new_tokens`` is
        not read): checked against the context left; None gives ``default_max_tokens``, within
        the context. ``draft``: serve with this draft by name (``"static"``: the
        starting draft kept static, when offered; ``"none"``: the target alone; a pool draft's
        name) instead of the router's choice; such requests train nothing unless the draft is
        the router's own. ``train=False``: never stored, never trained on. ``stream``: the
        handle gets the new text after every step (decoding it costs the engine thread time,
        so only streams ask for it). ``tenant``: who sent it (the API key's or a header's name,
        :mod:`onlinespec.serve.app`); its suffix-index lookups see that tenant's earlier requests
        only, unless the server shares the index (``CoreConfig.shared_suffix``).
        """
        if not self.ready:
            reason = self.error or ("the server is shutting down" if self.status in ("draining", "stopped") else f"the model is {self.status}")
            raise Unavailable(f"not ready: {reason}; retry when GET /ready answers 200")
        domain = self._domain(domain)
        ids = self.encode(prompt)
        params = params or SamplingParams()
        params = replace(params, max_new_tokens=self.max_new_tokens(len(ids), max_tokens))
        by_content = draft is None and self.pool.content is not None
        chosen = (self.pool.provisional(load=False) or self._on_engine(self.pool.provisional)) if by_content else self._draft(domain, draft)
        train = train and (chosen.learner is not None or chosen.suffix is not None)
        with self._lock:
            if len(self.scheduler.waiting) >= self.config.max_waiting:
                retry = max(1, math.ceil(self._recent_seconds * (1 + len(self.scheduler.waiting) / self.config.max_batch)))
                self.metrics.failures.labels("queue_full").inc()
                raise Overloaded(f"{len(self.scheduler.waiting)} requests are waiting (the limit is {self.config.max_waiting}): "
                                 f"retry in {retry} s", retry)
            state = RequestState(ids, params, StopChecker(params, self.eos, self.tokenizer), proposer=chosen.proposer,
                                 adaptive=chosen.adaptive, trace=[] if train and chosen.learner is not None else None,
                                 embed=by_content, tenant="" if self.config.shared_suffix else tenant)
            request_id = request_id or f"req-{next(_request_ids)}-{int(self.started_at)}"
            handle = Handle(self, state, chosen, domain, train, request_id, time.perf_counter() + self.config.request_timeout,
                            notify, prompt if self.config.log_text else "", stream)
            self._handles[state.id] = handle
            self.scheduler.submit(state)
        with self._wake:
            self._wake.notify()
        return handle

    def _domain(self, domain: str) -> str:
        """``domain`` if it is a label (:data:`onlinespec.safety.LABEL`) and within the server's
        ``max_domains`` distinct ones: a client's strings become metrics labels and routes, so
        both their shape and their number are bounded."""
        try:
            check_label(domain, "domain")
        except ValueError as err:
            raise ServeError(str(err), param="domain", code="invalid_domain") from None
        with self._lock:
            if domain not in self._domains:
                if len(self._domains) >= self.config.max_domains:
                    raise ServeError(f"domain {shown(domain)} is new and this server already serves {len(self._domains)} domains "
                                     f"(its --max-domains): send one it knows ({', '.join(sorted(self._domains)[:8])}...) "
                                     f"or leave domain out", param="domain", code="too_many_domains")
                self._domains.add(domain)
        return domain

    def _on_engine(self, fn: Callable):
        """Run ``fn`` on the engine thread between two steps and return its result (model work:
        a new draft's weights, a rollback's), so that one thread runs the model."""
        if threading.current_thread() is self._loop_thread:
            return fn()
        future: Future = Future()
        self._calls.put((fn, future))
        with self._wake:
            self._wake.notify()
        return future.result()

    def _run_calls(self) -> None:
        while not self._calls.empty():
            fn, future = self._calls.get_nowait()
            try:
                future.set_result(fn())
            except BaseException as err:
                future.set_exception(err)

    def _draft(self, domain: str, name: str | None) -> Draft:
        if name is None:  # a domain keeps its draft once routed: only a new one waits for the engine thread
            draft = self._routes.get(domain)
            if draft is None:
                draft = self._routes[domain] = self._on_engine(lambda: self.pool.route(domain))
            return draft
        if name in self.baselines:
            return self.baselines[name]
        if name in self.pool.drafts:
            return self.pool.drafts[name]
        offered = [*self.pool.drafts, *self.baselines]
        raise NotFound(f"no draft {shown(name)}: this server offers {offered} (or leave draft out to be routed)", param="draft")

    def cancel(self, handle: Handle) -> None:
        with self._lock:
            if self._handles.pop(handle.state.id, None) is None:
                return
        self.scheduler.cancel(handle.state)
        self._release(handle)
        self.metrics.running.set(len(self.scheduler.running))  # no step may come to update it
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.failures.labels("cancelled").inc()
        self.event({"event": "cancelled", "id": handle.request_id, "draft": handle.draft.name,
                    "new_tokens": len(handle.state.stop.generated)})

    def _fail(self, handle: Handle, error: ServeError) -> None:
        with self._lock:
            if self._handles.pop(handle.state.id, None) is None:
                return
        self.scheduler.cancel(handle.state)
        self._release(handle)
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self.metrics.failures.labels(error.kind).inc()
        self.event({"event": "failed", "id": handle.request_id, "draft": handle.draft.name, "error": error.message})
        handle.emit(error)

    # ---- the engine loop (one thread) ----------------------------------------------------------

    def _notify_engine(self) -> None:
        with self._wake:
            self._wake.notify()

    def _learn(self, idle: bool) -> None:
        """Give the learner a turn (onlinespec.online.turns): when idle, whenever it wants one; under
        load, while the share of the engine's time spent learning is below --learn-share."""
        turns = self.turns
        if turns is None:
            return
        if turns.due() if not idle else turns.wanted():
            self.metrics.learn_seconds.inc(turns.give())
        self.metrics.learn_share.set(turns.spent())

    def _loop(self) -> None:
        while True:
            with self._wake:
                while (not self.scheduler.has_work and not self._stopping and self._calls.empty()
                       and not (self.turns is not None and self.turns.wanted())):
                    self._wake.wait(0.25)
                    self._expire()
            self._run_calls()
            if self._stopping and not self.scheduler.has_work:
                return
            if not self.scheduler.has_work:
                self._learn(idle=True)
                continue
            self._expire()
            tick = time.perf_counter()
            try:
                advanced, report = self.scheduler.step()
            except Exception as err:  # two failed steps in a row (Scheduler.step): fail their requests, never the service
                logging.getLogger("onlinespec.serve").exception("a step failed")
                self._reset(f"{type(err).__name__}: {err}")
                continue
            if self.turns is not None:
                self.turns.served(time.perf_counter() - tick)
                self._learn(idle=False)
            kill_point("serve.step")
            self.metrics.running.set(len(self.scheduler.running))
            self.metrics.waiting.set(len(self.scheduler.waiting))
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
                    self.metrics.itl.observe((now - handle.last_emit) / len(state.new_tokens))
            handle.last_emit = now
        if handle.stream and (state.new_tokens or state.finished):
            delta, handle.emitted = text_delta(state, handle.emitted)
            handle.emit(Delta(delta, list(state.new_tokens)))
        if state.finished:
            with self._lock:
                self._handles.pop(state.id, None)
            self._finished.put(handle)

    def _route(self, handle: Handle) -> None:
        """Content routing, once the prompt is prefilled (engine thread, between two steps): the
        request's cluster; its cluster's draft records it; the best-scoring draft drafts for it
        from the next round on (a head drafted nothing in the first: it had no target feature)."""
        handle.routed = True
        state = handle.state
        if state.prompt_embedding is None:  # a model without hidden states to read, or nothing left to serve
            return
        route = self.pool.route_content(state.prompt_embedding, handle.domain, handle.request_id)
        state.prompt_embedding = None
        with self._lock:  # cancelled (or failed) meanwhile, on another thread: give the drafts back now
            if state.id not in self._handles:
                self.pool.release(route)
                return
            handle.route, handle.home, handle.draft = route, route.home, route.serve
        if route.serve.proposer is not state.proposer:
            # a head's state is the target's feature, whoever drafts; a draft LM's is its own cache: start afresh
            keep = type(route.serve.proposer) is type(state.proposer) and getattr(state.proposer, "uses_features", False)
            state.proposer, state.adaptive = route.serve.proposer, route.serve.adaptive
            if not keep:
                state.draft_state = state.proposer.start(state.prompt_ids)

    def _release(self, handle: Handle) -> None:
        if handle.route is not None:
            self.pool.release(handle.route)
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

    # ---- recording (one thread) ------------------------------------------------------------------

    def _record_loop(self) -> None:
        name_thread("onlinespec-rec")
        torch.set_num_threads(1)  # see the module docstring: the engine thread keeps the cores
        while (handle := self._finished.get()) is not None:
            try:
                self._complete(handle)
            except Exception as err:  # never leave a client waiting
                logging.getLogger("onlinespec.serve").exception("completing a request failed")
                handle.emit(Failed(f"the request finished but its answer could not be assembled: {err}"))

    def _housekeeping(self) -> None:
        """Every second: retention, and a CURRENT another process changed (a rollback loads a
        version here, one torch thread, never on the recorder: answers never wait for it)."""
        name_thread("onlinespec-house")
        torch.set_num_threads(1)
        while not self._stopping:
            time.sleep(TICK_SECONDS)
            try:
                self.pool.tick()
            except Exception:  # retention runs again next tick; the failure is on /metrics
                self.metrics.housekeeping_failures.inc()
                logging.getLogger("onlinespec.serve").exception("housekeeping failed (retention, a CURRENT from another process); "
                                                                "it runs again in %s s", TICK_SECONDS)

    def _complete(self, handle: Handle) -> None:
        try:
            self._answer(handle)
        finally:
            self._release(handle)

    def _answer(self, handle: Handle) -> None:
        state, draft, home, route = handle.state, handle.draft, handle.home, handle.route
        text = state.stop.text()
        generation = Generation(text, list(state.stop.generated), state.prompt_ids, state.stats, state.trace or [])
        recorded = False
        if home.learner is not None or home.suffix is not None:
            failures = home.learner.write_failures if home.learner is not None else 0
            try:  # durable when it returns; a record a disk write failed is skipped and counted
                recorded = self.pool.observe(home, generation, handle.domain, handle.request_id, train=handle.train, route=route,
                                             tenant=state.tenant)
            except Exception as err:
                logging.getLogger("onlinespec.serve").error("request %s: its training records were NOT stored: %s", handle.request_id, err)
            if home.learner is not None and home.learner.write_failures > failures:
                self.metrics.record_failures.labels(home.name).inc(home.learner.write_failures - failures)
            if not handle.train:
                self.metrics.opted_out.inc()
        stats = state.stats
        reason = "length" if stats.finish_reason == "length" else "stop"
        served = Served(handle.request_id, text, generation.token_ids, len(state.prompt_ids), reason, stats, draft.name,
                        draft.version, handle.versions or ([draft.version] if draft.version else []), handle.domain,
                        self.pool.busy, recorded, route.cluster if route else None, home.name if route else None, self.replica,
                        self.config.speculation_details)
        self.metrics.request(draft.name, draft.version, handle.domain, stats, speculative_decoding(stats))
        if self.controller is not None and draft.learner is not None:
            self._control(self.controller.served(draft.name, draft.version, stats.new_tokens, stats.target_calls))
        self.metrics.serving(draft.name, draft.version)
        if home.suffix is not None:
            self.metrics.suffix_tokens.labels(home.name).set(home.suffix.tokens)
        if home.learner is not None:
            data = home.learner.governance()
            self.metrics.buffer_records.labels(home.name).set(data["held"])
            self.metrics.buffer_bytes.labels(home.name).set(data["bytes"])
            if recorded:
                self.metrics.records.labels(home.name).inc()
        self._served += 1
        self._recent_seconds = 0.9 * self._recent_seconds + 0.1 * stats.seconds
        line = {"event": "request", "id": handle.request_id, "domain": handle.domain, "draft": draft.name,
                "draft_version": draft.version, "prompt_tokens": served.prompt_tokens, "completion_tokens": served.completion_tokens,
                "finish_reason": reason, "alpha": stats.acceptance_rate, "tau": stats.mean_accepted_length,
                "seconds": stats.seconds, "ttft_seconds": stats.first_token_seconds, "queued_seconds": stats.queued_seconds,
                "recorded": recorded}
        if route is not None:
            line.update(cluster=route.cluster, member_of=route.member_of, learning_draft=home.name)
        if self.replica is not None:
            line["replica"] = self.replica
        if self.config.log_text:
            line.update(prompt=handle.prompt_text, text=text)
        log.info(json.dumps(line))
        self.event(line)
        kill_point("serve.answer")
        self._release(handle)  # before the answer: a client's next request may need the room
        handle.emit(served)

    # ---- events and operators ---------------------------------------------------------------------

    def event(self, event: dict) -> None:
        event = self.events.write(event)  # a full disk: the log loses lines, serving goes on
        if self._on_event is not None:
            self._on_event(event)

    def _learner_event(self, event: dict) -> None:
        name = event.get("draft", "")
        if event["event"] == "update":
            self.metrics.update(name, event["outcome"], event["seconds"])
            if event["version"]:
                self.metrics.serving(name, event["version"])
        elif event["event"] == "update_failed":
            self.metrics.update(name, "failed")
        elif event["event"] == "learner_stopped":
            self.metrics.learner_stopped.labels(name).set(1)
        elif event["event"] in ("version", "rollback"):  # another process's version is served now
            self.metrics.serving(name, event["version"])
        if event["event"] == "update":  # an update ran to its end: the learner is (again) alive
            self.metrics.learner_stopped.labels(name).set(0)
        if self.pool.content is not None:
            self.metrics.routing(event, self.pool)
        self.event({**event, "requests_served": self._served})
        if self.controller is not None and event["event"] in ("update", "hurried"):
            self._control(self.controller.updated(name, event["version"], event["parent"], event["engine_seconds"])
                          if event["event"] == "update" else self.controller.drift(name))

    def _control(self, decisions: list[dict]) -> None:
        """Carry out the learning controller's decisions: each draft's update interval, the engine's share."""
        for decision in decisions:
            draft = self.pool.drafts.get(decision["draft"])
            if draft is not None and draft.learner is not None:
                draft.learner.backoff = decision["backoff"]
            self.turns.share = self.controller.share()
            self.metrics.learn_share_limit.set(self.turns.share)
            self.event({**decision, "requests_served": self._served})

    def drafts(self) -> list[dict]:
        """Every draft: what it serves, its versions (with their metadata), its learner's state."""
        rows = []
        for name, draft in [*self.pool.drafts.items(), *self.baselines.items()]:
            row = {"name": name, "version": draft.version, "learning": draft.learner is not None}
            if draft.suffix is not None:
                row["suffix_index"] = draft.suffix.stats()
            if draft.learner is not None:
                row.update(learner_row(draft.learner))
            rows.append(row)
        if self.pool.content is not None:  # content routing: where each draft is, and what it serves
            routing = self.pool.routing()
            homes: dict[str, list[int]] = {}
            for cluster in routing["clusters"]:
                homes.setdefault(cluster["draft"], []).append(cluster["cluster"])
            for row in rows:
                row.update(state="in memory", clusters=homes.get(row["name"], []))
            rows += [{"name": n, "state": "evicted (in its registry; reloaded when its cluster returns)", "clusters": homes.get(n, []),
                      "learning": True} for n in routing["evicted"]]
            rows += [{"name": n, "state": f"retired: {why}", "learning": False} for n, why in routing["retired"].items()]
        return rows

    def replica_rows(self) -> list[dict]:
        """The serving replicas (one process: none; see onlinespec.scale)."""
        return []

    def routing(self) -> dict:
        """Content routing's clusters, lifecycle counts and detections (empty for other routers)."""
        return self.pool.routing()

    def learning(self) -> dict:
        """Whether the drafts learn, and the engine time it takes: the share allowed now (the
        controller's, at most --learn-share), the share spent over the last 30 s, the seconds given."""
        state = {"learning": self.config.learning, "paused": self.pool.paused, "busy": self.pool.busy}
        if self.turns is not None:
            state.update(share_limit=round(self.turns.share, 4), share_spent=round(self.turns.spent(), 4),
                         engine_seconds=round(self.turns.learn_seconds_total, 3), turns=self.turns.turns_total,
                         longest_turn_seconds=round(self.turns.longest_turn_seconds, 3),
                         backoff={name: d.learner.backoff for name, d in self.pool.drafts.items() if d.learner is not None})
        return state

    def governance(self) -> dict:
        """What the core did with the training data (:meth:`DraftPool.governance`)."""
        return self.pool.governance()

    def purge(self, request_id: str | None = None, older_than_days: float | None = None) -> dict:
        """Delete a request's training records (or those older than a number of days) now."""
        if (request_id is None) == (older_than_days is None):
            raise ServeError("give exactly one of request_id and older_than_days", code="invalid_purge")
        if older_than_days is not None and not older_than_days >= 0:
            raise ServeError(f"older_than_days must be >= 0, got {older_than_days}", param="older_than_days")
        before = None if older_than_days is None else time.time() - older_than_days * 86400.0
        indexed = self.pool.suffix_purged
        removed = self.pool.purge(request_id, before)
        indexed = self.pool.suffix_purged - indexed
        self.events.drop(request_id, before)  # the log's lines about it go too (with --log-text they hold its text)
        self.event({"event": "purge", "request_id": request_id, "older_than_days": older_than_days, "records": removed,
                    "suffix_requests": indexed})
        return {"records_deleted": removed, "suffix_requests_deleted": indexed, "governance": self.governance()}

    def operate(self, action: str, name: str | None = None, version: str | None = None) -> dict:
        """An operator's action (:func:`operate`); the model work of a rollback or a pin runs on
        the engine thread. Returns the new state."""
        if not self.config.learning:
            raise ServeError("this server does not learn (started with --static or --draft none)", code="not_learning")
        result = operate(self.pool, action, name, version, self._on_engine)
        if action in ("pause", "resume"):
            result = self.learning()
        if name in self.pool.drafts and action in ("rollback", "pin"):
            self.metrics.serving(name, self.pool.drafts[name].learner.registry.current())
        self.event({"event": "admin", "action": action, "draft": name, "version": version, "result": result})
        return result


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
