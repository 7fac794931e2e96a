"""A small draft language model with its own KV cache per request (the paper's setting).

Each request's cache lives in its :class:`DraftLMState`; a batch is drafted one request after
another (the draft LM is not the default draft; batching it would take the target's hole-masked
cache, :mod:`onlinespec.decoding.batch_cache`, for the draft too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from onlinespec.decoding.batch_cache import cache_arg
from onlinespec.decoding.kvcache import truncate_cache
from onlinespec.decoding.proposal import DraftInput, Proposal
from onlinespec.decoding.proposers.base import ModelSlot, PerRequestProposer, SwappableDraft
from onlinespec.decoding.sampling import logits_to_probs, sample


@dataclass
class DraftLMState:
    model: PreTrainedModel | None = None  # the draft the cache was computed with
    cache: DynamicCache | None = None
    seen: list[int] = field(default_factory=list)  # the token ids whose keys/values are in the cache


class DraftModelProposer(PerRequestProposer, SwappableDraft):
    """Runs the draft autoregressively for ``k`` steps, reusing its KV cache across rounds."""

    def __init__(self, model: PreTrainedModel, name: str = "draft", version: str = "v0") -> None:
        self.name = name
        self.slot = ModelSlot(model, version)

    def start(self, prompt_ids: list[int]) -> DraftLMState:
        return DraftLMState()

    @torch.inference_mode()
    def propose_one(self, d: DraftInput) -> Proposal:
        state = d.state if d.state is not None else DraftLMState()
        model = self.model
        if state.model is not model:  # a new request, or a draft swapped in since its last round
            state.model, state.cache, state.seen = model, DynamicCache(config=model.config), []
        pending = resync(state.seen, d.ids, lambda n: truncate_cache(state.cache, n))
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        forward = 0.0
        for _ in range(d.k):
            start = time.perf_counter()
            logits = model(input_ids=torch.tensor([pending]), logits_to_keep=1, **cache_arg(model, state.cache)).logits[0, -1]
            forward += time.perf_counter() - start
            state.seen.extend(pending)
            tokens.append(draft_token(logits, d, rows))
            pending = [tokens[-1]]
        return Proposal(tokens, torch.stack(rows) if rows else None, forward, drafter=self.drafter)


def draft_token(logits: torch.Tensor, d: DraftInput, rows: list[torch.Tensor]) -> int:
    """A draft model's next token from its ``logits``: the argmax for a greedy request, else a draw
    from its processed distribution with the request's generator; the distribution goes to
    ``rows`` when the verifier needs it (sampled, or asked for with ``with_probs``)."""
    if d.params.greedy:
        if d.with_probs:
            rows.append(logits.float().softmax(-1))
        return int(logits.argmax())
    probs = logits_to_probs(logits, d.params)
    rows.append(probs)
    return sample(probs, d.generator)


def resync(seen: list[int], ids: list[int], truncate: Callable[[int], None]) -> list[int]:
    """Cut a draft's cache (``truncate(n)`` keeps its first n positions) and ``seen``, the ids it
    holds, to what ``ids`` begins with (the engine discarded the rest); return the ids still to
    feed, at least the last one (its logits are the first draft's)."""
    if ids[: len(seen)] == seen:
        common = len(seen)
    else:
        shorter = min(len(ids), len(seen))
        common = next((i for i in range(shorter) if ids[i] != seen[i]), shorter)
    common = min(common, len(ids) - 1)
    if common < len(seen):
        truncate(common)
        del seen[common:]
    return ids[common:]
