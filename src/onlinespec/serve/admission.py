"""What a request must pass before it queues: its prompt encodes, its token budget fits the
model's context, its domain is a label within the server's bound, a draft it names exists, and
the queue has room. Each refusal is a :class:`~onlinespec.serve.handles.ServeError` that names the
field at fault."""

from __future__ import annotations

import math
import threading

from onlinespec.decoding.engine import SpeculativeEngine
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.scheduler import FairScheduler
from onlinespec.online.pool import ServedDraft
from onlinespec.safety import check_label, shown
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import NotFound, Overloaded, ServeError
from onlinespec.serve.prompts import ChatPrompt, TextPrompt, render
from onlinespec.serve.protocol import MAX_CHOICES
from onlinespec.tokens import Prompt, encode_prompt

MAX_PROMPT_LOGPROB_ENTRIES = 1 << 15  # a choice's prompt log probabilities: prompt tokens x (1 + alternatives) (docs/serve.md)


def encode(tokenizer, vocab_size: int, prompt: Prompt | ChatPrompt | TextPrompt) -> list[int]:
    """The prompt's token ids (a chat through the tokenizer's template; a request's rendering
    options with it, :mod:`onlinespec.serve.prompts`)."""
    try:
        if isinstance(prompt, (ChatPrompt, TextPrompt)):
            ids = render(tokenizer, prompt)
            if not ids:
                raise ValueError("the prompt is empty: give at least one character of text or one chat message")
            return ids
        return encode_prompt(tokenizer, prompt, vocab_size)
    except ServeError:
        raise
    except (ValueError, TypeError) as err:
        chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        raise ServeError(str(err), param="messages" if chat else "prompt") from None
    except Exception as err:  # a chat template that rejects the conversation (e.g. role order)
        raise ServeError(f"the chat template could not render these messages: {err}", param="messages") from None


def admit_budget(engine: SpeculativeEngine, params: SamplingParams, prompt_tokens: int, default: int | None, vocab_size: int) -> int:
    """The new tokens this request gets, what its stop check stops at: ``params.max_new_tokens``
    (the request's ``max_tokens``), or when None ``default`` (``--default-max-tokens``) within
    the context left, or all of it (as vLLM). One question to the engine
    (:meth:`~onlinespec.decoding.engine.SpeculativeEngine.budget`); refused first when a token
    id the params name is past the vocabulary, then when the budget does not fit the context
    (``context_length_exceeded``) or is less than ``min_tokens``."""
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
        past = [t for t in ids if t >= vocab_size]
        if past:
            raise ServeError(f"{name}: token id {past[0]} is past the vocabulary (ids are 0..{vocab_size - 1})", param=name)
    if params.prompt_logprobs is not None and prompt_tokens * (1 + params.prompt_logprobs) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ServeError(f"prompt_logprobs (or echo with logprobs) = {params.prompt_logprobs} over {prompt_tokens} prompt tokens asks for "
                         f"{prompt_tokens * (1 + params.prompt_logprobs)} log probabilities per choice: the limit is "
                         f"{MAX_PROMPT_LOGPROB_ENTRIES} (prompt tokens x (1 + alternatives)); ask for fewer alternatives or a shorter prompt",
                         param="prompt_logprobs", code="prompt_logprobs_too_large")
    asked = params.max_new_tokens
    try:
        budget = engine.budget(prompt_tokens, asked, name="max_tokens")  # the client's name for it
    except ValueError as err:
        raise ServeError(str(err), param="max_tokens" if asked is not None else "messages", code="context_length_exceeded") from None
    if asked is None and default is not None:
        budget = min(budget, default)
    if params.min_tokens > budget:
        raise ServeError(f"min_tokens = {params.min_tokens} is more than the {budget} new tokens this request may have "
                         f"(max_tokens, or the context left)", param="min_tokens")
    return budget


class Domains:
    """The request domains a server has seen, at most ``limit``: a client's strings become metrics
    labels and routes, so both their shape (:data:`onlinespec.safety.LABEL`) and their number are
    bounded. A refusal names only the domains the caller's own tenant sent (and ``default``):
    one tenant never learns another's domain names from an error."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.known: dict[str, str] = {"default": ""}  # domain -> the tenant that first sent it ("": everyone's)
        self._lock = threading.Lock()

    def admit(self, domain: str, tenant: str = "") -> str:
        try:
            check_label(domain, "domain")
        except ValueError as err:
            raise ServeError(str(err), param="domain", code="invalid_domain") from None
        with self._lock:
            if domain not in self.known:
                if len(self.known) >= self.limit:
                    yours = sorted(d for d, first in self.known.items() if first in ("", tenant))
                    listed = ", ".join(yours[:8]) + (", ..." if len(yours) > 8 else "")
                    raise ServeError(f"domain {shown(domain)} is new and this server already serves its limit of {self.limit} domains "
                                     f"(--max-domains): send one it serves (yours: {listed}) or leave domain out",
                                     param="domain", code="too_many_domains")
                self.known[domain] = tenant
        return domain


def named_draft(name: str, drafts: dict[str, ServedDraft], baselines: dict[str, ServedDraft]) -> ServedDraft:
    """The draft a request names instead of the router's choice: a baseline or a pool draft."""
    if name in baselines:
        return baselines[name]
    if name in drafts:
        return drafts[name]
    offered = [*drafts, *baselines]
    raise NotFound(f"no draft {shown(name)}: this server offers {offered} (or leave draft out to be routed)", param="draft")


def queue_full(waiting: int, config: CoreConfig, recent_seconds: float) -> Overloaded:
    """The refusal (429) of a request that finds the queue full: retry once those waiting have
    likely started (``recent_seconds``: a recent request's seconds, a batch at a time)."""
    retry = max(1, math.ceil(recent_seconds * (1 + waiting / config.max_batch)))
    return Overloaded(f"{waiting} requests are waiting (the limit is {config.max_waiting}): retry in {retry} s", retry)


def check_room(scheduler: FairScheduler, config: CoreConfig, tenant: str, group: object, recent_seconds: float, failures=None) -> None:
    """429 (:class:`Overloaded`) for a new request when ``--max-waiting`` requests (HTTP requests,
    whatever their choices) already wait for a slot, or when its tenant's waiting choices already
    hold ``--tenant-max-queued-tokens`` tokens (their text and the new tokens left in their
    budgets). A request's later choices join its first: a request once accepted is never cut
    (``group``: the tenant and request id its choices share; a reused id joins at most
    :data:`~onlinespec.serve.protocol.MAX_CHOICES` choices unchecked). ``failures``: the
    ``request_failure_total`` counter a refusal counts on (reason ``queue_full``)."""
    if 0 < scheduler.group_size(group) < MAX_CHOICES:
        return
    try:
        _check_room(scheduler, config, tenant, recent_seconds)
    except Overloaded:
        if failures is not None:
            failures.labels("queue_full").inc()
        raise


def _check_room(scheduler: FairScheduler, config: CoreConfig, tenant: str, recent_seconds: float) -> None:
    waiting = scheduler.waiting_requests()
    if waiting >= config.max_waiting:
        raise queue_full(waiting, config, recent_seconds)
    queued, cap = scheduler.queued_tokens(tenant), config.tenant_max_queued_tokens
    if cap is not None and queued >= cap:
        retry = max(1, math.ceil(recent_seconds))
        raise Overloaded(f"your requests waiting for a slot already hold {queued} tokens (prompts and max_tokens left; the limit per "
                         f"tenant is {cap}, --tenant-max-queued-tokens): retry in {retry} s, or send fewer choices or a smaller max_tokens",
                         retry)
