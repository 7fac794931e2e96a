"""n-gram lookup where the text offers a match, the suffix index of earlier requests, a learned
draft elsewhere.

The target copies a lot (code identifiers, numbers from a math question, its own earlier
sentences): there prompt lookup is free and often right for several tokens in a row. What it
said in earlier requests it tends to say again (:mod:`onlinespec.decoding.proposers.suffix`):
the suffix index proposes that, also for free. Where neither matches, the learned draft proposes.

Per round and request: a prompt-lookup match wins; else a suffix-index match is taken when its
expected accepted length (from its confidences, calibrated on its own measured acceptance in the
request's adaptive-k statistics) is at least the learned draft's (from the learned draft's
measured per-step acceptance); else the learned draft drafts. The choice reads only the text so
far and past statistics, never a random draw, so sampled output keeps the target's distribution.
A batch splits: the requests left to the learned draft go to it in one call. The engine's
adaptive k then judges each drafter by its own measured acceptance (``Proposal.drafter``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from onlinespec.decoding.acceptance import expected_tokens
from onlinespec.decoding.proposal import DEFAULT_K, DraftInput, Proposal
from onlinespec.decoding.proposers.base import ModelSlot, SwappableDraft
from onlinespec.decoding.proposers.suffix import SuffixIndex, propose_model_free


class HybridProposer(SwappableDraft):
    """Swappable, and feature-reading when its learned draft is: the learner trains that draft."""

    free_drafts = True

    def __init__(self, learned: SwappableDraft, max_ngram: int = 3, min_ngram: int = 2, suffix_index: SuffixIndex | None = None,
                 min_match: int = 3, learned_k: int | None = DEFAULT_K) -> None:
        """``min_ngram``: the shortest prompt-lookup match that wins over the learned draft;
        ``min_match``: the shortest suffix-index match considered (``suffix_index=None``: none);
        ``learned_k``: the most tokens the learned draft proposes a round (each costs a draft
        step; copies cost nothing, so with the engine's ``k`` above it only they propose more;
        default: the engine's default ``k``). ``None``: as many as the engine asks."""
        self.learned, self.learned_k = learned, learned_k
        self.max_ngram, self.min_ngram, self.min_match = max_ngram, min_ngram, min_match
        self.suffix_index = suffix_index
        self.name = f"hybrid(ngram:{max_ngram}{'+suffix' if suffix_index is not None else ''}+{learned.name})"
        self.uses_features = learned.uses_features

    @property
    def paid_drafter(self) -> str:
        return self.learned.drafter

    @property
    def slot(self) -> ModelSlot:
        """The learned draft's: it is what the online learner trains and swaps."""
        return self.learned.slot

    def swap_model(self, model, version: str) -> None:
        self.learned.swap_model(model, version)

    def memory_objects(self) -> list:
        return self.learned.memory_objects()

    def start(self, prompt_ids: list[int]):
        return self.learned.start(prompt_ids)

    def observe(self, state, feature: torch.Tensor) -> None:
        self.learned.observe(state, feature)

    def propose(self, batch: Sequence[DraftInput]) -> list[Proposal]:
        out: list[Proposal | None] = []
        for d in batch:
            free = propose_model_free(d, self.suffix_index, self.max_ngram, self.min_ngram, self.min_match)
            if free is not None and free.drafter == "suffix" and not self._suffix_pays(free, d):
                free = None
            out.append(free)
        rest = [i for i, p in enumerate(out) if p is None]
        cap = self.learned_k
        asks = [batch[i] if cap is None or batch[i].k <= cap else replace(batch[i], k=cap) for i in rest]
        for i, proposal in zip(rest, self.learned.propose(asks) if rest else []):
            out[i] = proposal
        return out

    def propose_free(self, batch: Sequence[DraftInput]) -> list[Proposal]:
        """Prompt lookup, then the suffix index: no learned draft to weigh them against."""
        return [propose_model_free(d, self.suffix_index, self.max_ngram, self.min_ngram, self.min_match) or Proposal(drafter="ngram")
                for d in batch]

    def _suffix_pays(self, proposal: Proposal, d: DraftInput) -> bool:
        """Whether the suffix index's proposal is expected to be accepted at least as far as the
        learned draft's (always, without statistics to judge by)."""
        if d.adaptive is None:
            return True
        # the bins a request's own verdicts calibrate: by confidence when greedy, by step when sampled
        mine = expected_tokens(d.adaptive.estimates(proposal, use_confidence=d.params.greedy), len(proposal))
        k = d.k if self.learned_k is None else min(d.k, self.learned_k)
        learned = expected_tokens(d.adaptive.drafter_estimates(self.learned.drafter, k), k)
        return mine >= learned
