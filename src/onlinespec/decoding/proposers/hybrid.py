"""n-gram lookup where the text offers a match, a learned draft elsewhere.

The target copies a lot (code identifiers, numbers from a math question, its own earlier
sentences): there prompt lookup is free and often right for several tokens in a row. Where no
earlier text matches, the learned draft proposes. The engine's adaptive-k policy then judges
each source by its own measured acceptance (``Proposal.source``).
"""

from __future__ import annotations

import numpy as np
import torch

from onlinespec.decoding.proposers.base import Proposal
from onlinespec.decoding.proposers.ngram import lookup
from onlinespec.decoding.sampling import SamplingParams


class HybridProposer:
    def __init__(self, learned, max_ngram: int = 3, min_ngram: int = 2) -> None:
        """``min_ngram``: the shortest suffix match that wins over the learned draft."""
        self.learned = learned
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"hybrid(ngram:{max_ngram}+{learned.name})"
        self.uses_features = getattr(learned, "uses_features", False)

    @property
    def version(self) -> str:
        return getattr(self.learned, "version", "v0")

    @version.setter
    def version(self, value: str) -> None:
        self.learned.version = value

    @property
    def model(self):
        """The learned draft (the online learner copies and swaps it)."""
        return self.learned.model

    def swap_model(self, model, version: str) -> None:
        self.learned.swap_model(model, version)

    def begin(self, prompt_ids: list[int]) -> None:
        self.learned.begin(prompt_ids)

    def observe(self, feature: torch.Tensor) -> None:
        self.learned.observe(feature)

    def propose(
        self,
        ids: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        with_probs: bool = False,
    ) -> Proposal:
        copied = lookup(np.asarray(ids), k, self.max_ngram, self.min_ngram)
        if copied:
            return Proposal(tokens=copied, source="ngram")
        return self.learned.propose(ids, k, params, generator, with_probs)
