"""What the serving core gives its callers: a request's handle and events, and the errors it raises.

The HTTP app (:mod:`onlinespec.serve.app`), the Ray front and replicas (:mod:`onlinespec.scale`)
and stream clients (:mod:`onlinespec.stream`) work with these types only, never with the core's
threads: a Ray replica's events and errors cross processes as they are, and the front relays them
to the same app code as one process's core.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field

from onlinespec.decoding.logprobs import TokenLogprob
from onlinespec.decoding.request import RequestState, RequestStats
from onlinespec.metrics import speculative_decoding
from onlinespec.online.pool import ServedDraft
from onlinespec.routing.domains import RESERVED
from onlinespec.routing.lifecycle import Route

STATIC, TARGET_ALONE = RESERVED  # drafts a request may ask for by name, never trained on


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


class Unprocessable(ServeError):
    """A field of the wrong type or out of range (422, naming it)."""

    status = 422


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
    prompt_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # per new token, when the request asked (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (None for the first), when asked

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def metrics(self) -> dict:
        """A response's ``metrics``: the request's speculation figures in vLLM's per-request shape
        with the draft and version that served it, and its timings."""
        spec = {**speculative_decoding(self.stats), "draft": self.draft, "draft_version": self.draft_version,
                "draft_versions": self.draft_versions}
        if not self.details:  # which tokens the suffix index proposed says what earlier requests held
            spec.pop("by_drafter")
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
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when the request asked


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
    """A request submitted to this process's core, with what its engine loop keeps of it."""

    def __init__(self, cancel: Callable[[Handle], None], state: RequestState, draft: ServedDraft, domain: str, train: bool,
                 request_id: str, deadline: float, notify: Callable[[], None] | None = None, prompt_text: str = "",
                 stream: bool = False) -> None:
        super().__init__(notify)
        self._cancel, self.state, self.draft, self.domain, self.train = cancel, state, draft, domain, train
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
        self._cancel(self)
