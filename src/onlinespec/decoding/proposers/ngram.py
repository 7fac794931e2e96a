"""Model-free n-gram prompt lookup: copy what followed the last occurrence of the current suffix.

The proposals are deterministic (point masses), so the exact sampler accepts a proposal ``x``
with probability ``p(x)``: still lossless. Costs no model forward at all.
"""

from __future__ import annotations

import numpy as np
import torch

from onlinespec.decoding.proposers.base import Proposal
from onlinespec.decoding.sampling import SamplingParams


class NgramProposer:
    """Match the last ``max_ngram`` .. ``min_ngram`` tokens against earlier text of the request."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"ngram:{max_ngram}"

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(
        self,
        ids: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        with_probs: bool = False,
    ) -> Proposal:
        return Proposal(tokens=lookup(np.asarray(ids), k, self.max_ngram, self.min_ngram), source="ngram")


def lookup(ids: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix."""
    n_ids = len(ids)
    for n in range(min(max_ngram, n_ids - 1), min_ngram - 1, -1):
        suffix = ids[n_ids - n:]
        # windows[i] = ids[i : i + n] for every start i whose match is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(ids[: n_ids - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            start = int(starts[-1]) + n
            return ids[start: start + k].tolist()
    return []
