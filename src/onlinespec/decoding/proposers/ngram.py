"""Model-free n-gram prompt lookup: copy what followed the last occurrence of the current suffix.

The proposals are deterministic (point masses), so the exact sampler accepts a proposal ``x``
with probability ``p(x)``: still lossless. Costs no model forward at all, and needs no state:
each request's lookup reads only its own tokens.
"""

from __future__ import annotations

import numpy as np

from onlinespec.decoding.proposal import DraftInput, Proposal
from onlinespec.decoding.proposers.base import PerRequestProposer


class NgramProposer(PerRequestProposer):
    """Match the last ``max_ngram`` .. ``min_ngram`` tokens against earlier text of the request."""

    drafter = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"ngram:{max_ngram}"

    def propose_one(self, d: DraftInput) -> Proposal:
        return Proposal(tokens=lookup(np.asarray(d.ids), d.k, self.max_ngram, self.min_ngram), drafter=self.drafter)


def lookup(ids: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix."""
    n_ids = len(ids)
    if k <= 0:
        return []
    for n in range(min(max_ngram, n_ids - 1), min_ngram - 1, -1):
        suffix = ids[n_ids - n:]
        # windows[i] = ids[i : i + n] for every start i whose match is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(ids[: n_ids - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            start = int(starts[-1]) + n
            return ids[start: start + k].tolist()
    return []
