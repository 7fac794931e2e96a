"""What a request must pass before it queues: its prompt encodes, its token budget fits the
model's context, its domain is a label within the server's bound, a draft it names exists, and
the queue has room. Each refusal is a :class:`~onlinespec.serve.handles.ServeError` that names the
field at fault."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

from onlinespec.decoding.engine import SpeculativeEngine
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.online.pool import Draft
from onlinespec.safety import check_label, shown
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import NotFound, Overloaded, ServeError
from onlinespec.tokens import Prompt, encode_prompt


def encode(tokenizer, vocab_size: int, prompt: Prompt) -> list[int]:
    """The prompt's token ids (a chat through the tokenizer's template)."""
    try:
        return encode_prompt(tokenizer, prompt, vocab_size)
    except (ValueError, TypeError) as err:
        chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        raise ServeError(str(err), param="messages" if chat else "prompt") from None
    except Exception as err:  # a chat template that rejects the conversation (e.g. role order)
        raise ServeError(f"the chat template could not render these messages: {err}", param="messages") from None


def admit_params(engine: SpeculativeEngine, params: SamplingParams, prompt_tokens: int, requested: int | None,
                 default: int | None, vocab_size: int) -> SamplingParams:
    """``params`` with the request's token budget (:func:`token_budget`), once the token ids it
    names are in the vocabulary and ``min_tokens`` is within the budget."""
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
        past = [t for t in ids if t >= vocab_size]
        if past:
            raise ServeError(f"{name}: token id {past[0]} is past the vocabulary (ids are 0..{vocab_size - 1})", param=name)
    budget = token_budget(engine, prompt_tokens, requested, default)
    if params.min_tokens > budget:
        raise ServeError(f"min_tokens = {params.min_tokens} is more than the {budget} new tokens this request may have "
                         f"(max_tokens, or the context left)", param="min_tokens")
    return replace(params, max_new_tokens=budget)


def token_budget(engine: SpeculativeEngine, prompt_tokens: int, requested: int | None, default: int | None) -> int:
    """The request's budget: what it asked, or ``default`` (None: all the context left, as vLLM),
    within the context left; a prompt that leaves no room, or a request for more than is left,
    is a clear error."""
    room = engine.room(prompt_tokens)
    if room < 1:
        raise ServeError(f"the prompt has {prompt_tokens} tokens: the model's context is {engine.context} tokens, "
                         f"so a prompt may have at most {engine.context - engine.k - 2}", param="messages", code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(room, default)
    try:
        engine.check_fits(prompt_tokens, requested, "max_tokens")
    except ValueError as err:
        raise ServeError(str(err), param="max_tokens", code="context_length_exceeded") from None
    return requested


class Domains:
    """The request domains a server has seen, at most ``limit``: a client's strings become metrics
    labels and routes, so both their shape (:data:`onlinespec.safety.LABEL`) and their number are
    bounded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.known: set[str] = {"default"}
        self._lock = threading.Lock()

    def admit(self, domain: str) -> str:
        try:
            check_label(domain, "domain")
        except ValueError as err:
            raise ServeError(str(err), param="domain", code="invalid_domain") from None
        with self._lock:
            if domain not in self.known:
                if len(self.known) >= self.limit:
                    raise ServeError(f"domain {shown(domain)} is new and this server already serves {len(self.known)} domains "
                                     f"(its --max-domains): send one it knows ({', '.join(sorted(self.known)[:8])}...) "
                                     f"or leave domain out", param="domain", code="too_many_domains")
                self.known.add(domain)
        return domain


def named_draft(name: str, drafts: dict[str, Draft], baselines: dict[str, Draft]) -> Draft:
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
