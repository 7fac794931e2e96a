"""Model-free n-gram prompt lookup: copy what followed the last occurrence of the current suffix.

The proposals are deterministic (point masses), so the exact sampler accepts a proposal ``x``
with probability ``p(x)``: still lossless. Costs no model forward at all, and needs no state:
each request's lookup reads only its own tokens.

A copy's confidence grows with the evidence behind it: how many tokens before the current
position match the text before the copied span (:func:`copy_confidence`). A long verbatim match
(a quoted sentence, a repeated code line) is a copy the target tends to continue; a two-token match
is often chance. Adaptive k calibrates these confidences against measured acceptance per bin, so
they need only rank copies, not be probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onlinespec.decoding.proposal import DraftInput, Proposal
from onlinespec.decoding.proposers.base import PerRequestProposer


class NgramProposer(PerRequestProposer):
    """Match the last ``max_ngram`` .. ``min_ngram`` tokens against earlier text of the request."""

    drafter = "ngram"
    free_drafts = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"ngram:{max_ngram}"

    def propose_free(self, batch: Sequence[DraftInput]) -> list[Proposal]:
        return self.propose(batch)

    def propose_one(self, d: DraftInput) -> Proposal:
        return copy_proposal(np.asarray(d.ids), d.k, self.max_ngram, self.min_ngram) or Proposal(drafter=self.drafter)


# The longest match, in tokens, that :func:`copy_confidence` tells apart from a shorter one.
MAX_EVIDENCE = 32


def lookup(ids: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix."""
    return _match(ids, k, max_ngram, min_ngram)[0]


def copy_proposal(ids: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> Proposal | None:
    """:func:`lookup`'s copy as a proposal whose confidences weigh the match behind it (None: no match)."""
    tokens, matched = _match(ids, k, max_ngram, min_ngram)
    if not tokens:
        return None
    return Proposal(tokens=tokens, confidences=[copy_confidence(matched)] * len(tokens), drafter="ngram")


def copy_confidence(matched: int) -> float:
    """A copy behind a match of ``matched`` tokens: 0.5 for two, 0.8 for eight, 0.94 for 32 or more.
    (Adaptive k's prior for a bin it has not measured yet, then only a rank.)"""
    matched = min(matched, MAX_EVIDENCE)
    return matched / (matched + 2)


def _match(ids: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """The copy (up to ``k`` tokens), and how many tokens before it match the text before the
    current end, up to :data:`MAX_EVIDENCE` (at least the n-gram's length)."""
    n_ids = len(ids)
    if k <= 0 or n_ids < 2:
        return [], 0
    ends = np.flatnonzero(ids[: n_ids - 1] == ids[-1])  # earlier positions holding the last token
    for n in range(min(max_ngram, n_ids - 1), min_ngram - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):  # ... whose n - 1 tokens before match too
            found = found[ids[found - back] == ids[n_ids - 1 - back]]
        if len(found):
            end = int(found[-1])  # the most recent occurrence
            return ids[end + 1: end + 1 + k].tolist(), n + _extends_back(ids, end + 1 - n, n_ids - n)
    return [], 0


def _extends_back(ids: np.ndarray, earlier: int, later: int) -> int:
    """How many tokens right before ``earlier`` equal those right before ``later`` (capped)."""
    most = min(earlier, MAX_EVIDENCE)
    if most <= 0:
        return 0
    same = ids[earlier - most: earlier][::-1] == ids[later - most: later][::-1]
    return int(most if same.all() else np.argmin(same))
