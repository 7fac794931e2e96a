"""n-gram lookup where the text offers a match, a learned draft elsewhere.

The target copies a lot (code identifiers, numbers from a math question, its own earlier
sentences): there prompt lookup is free and often right for several tokens in a row. Where no
earlier text matches, the learned draft proposes. A batch splits: every request is looked up on
its own, and the requests with no match go to the learned draft in one call. The engine's
adaptive-k policy then judges each source by its own measured acceptance (``Proposal.source``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from onlinespec.decoding.proposers.base import DraftInput, ModelSlot, Proposal, SwappableDraft
from onlinespec.decoding.proposers.ngram import lookup


class HybridProposer(SwappableDraft):
    def __init__(self, learned, max_ngram: int = 3, min_ngram: int = 2) -> None:
        """``min_ngram``: the shortest suffix match that wins over the learned draft."""
        self.learned = learned
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"hybrid(ngram:{max_ngram}+{learned.name})"
        self.uses_features = getattr(learned, "uses_features", False)

    @property
    def slot(self) -> ModelSlot:
        """The learned draft's: it is what the online learner trains and swaps."""
        return self.learned.slot

    def swap_model(self, model, version: str) -> None:
        self.learned.swap_model(model, version)

    def start(self, prompt_ids: list[int]):
        return self.learned.start(prompt_ids)

    def observe(self, state, feature: torch.Tensor) -> None:
        self.learned.observe(state, feature)

    def propose(self, batch: Sequence[DraftInput]) -> list[Proposal]:
        out: list[Proposal | None] = []
        for d in batch:
            copied = lookup(np.asarray(d.ids), d.k, self.max_ngram, self.min_ngram)
            out.append(Proposal(tokens=copied, source="ngram") if copied else None)
        rest = [i for i, p in enumerate(out) if p is None]
        for i, proposal in zip(rest, self.learned.propose([batch[i] for i in rest]) if rest else []):
            out[i] = proposal
        return out
