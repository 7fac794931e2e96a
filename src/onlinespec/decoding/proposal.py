"""What a drafter is asked (:class:`DraftInput`) and what it answers (:class:`Proposal`).

The bottom of decoding/: the engine, the step planner, the acceptance statistics and every
proposer speak these values, so they import nothing above :mod:`onlinespec.decoding.sampling`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from onlinespec.decoding.sampling import SamplingParams

DEFAULT_K = 4  # the most proposals per round; adaptive k verifies fewer when they would not pay


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    # [len(tokens), V]: the distribution each token was drawn from (sampling), or the draft's
    # temperature-1 distribution (greedy, when asked for). None: each token is a point mass.
    probs: torch.Tensor | None = None
    forward_seconds: float = 0.0  # time spent in model forwards, for the engine's accounting
    # The draft's own probability of each proposal (its confidence), when it has one; the
    # adaptive-k policy calibrates it against measured acceptance.
    confidences: list[float] | None = None
    drafter: str = "draft"  # which drafter made it (a hybrid proposer mixes several)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class DraftInput:
    """One request's part of a batched :meth:`~onlinespec.decoding.proposers.base.Proposer.propose` call."""

    ids: list[int]  # the request's tokens so far (prompt + generated)
    k: int  # propose at most this many
    params: SamplingParams
    generator: torch.Generator | None  # the request's own: draws never depend on the batch
    state: Any = None  # what :meth:`Proposer.start` returned for this request
    with_probs: bool = False  # return full rows in ``Proposal.probs`` even when greedy
    # The request's draft acceptance statistics (an AdaptiveK; None: fixed k): a proposer that
    # can draft several ways may pick, per round, the one expected to be accepted furthest.
    adaptive: Any = None
    tenant: str = ""  # whose earlier requests a suffix index may draft from (SuffixIndex.match)


def trim(proposal: Proposal, n: int) -> Proposal:
    """The first ``n`` proposals of ``proposal`` (itself when it holds no more)."""
    if n >= len(proposal):
        return proposal
    return Proposal(
        proposal.tokens[:n],
        proposal.probs[:n] if proposal.probs is not None else None,
        proposal.forward_seconds,
        proposal.confidences[:n] if proposal.confidences is not None else None,
        proposal.drafter,
    )
