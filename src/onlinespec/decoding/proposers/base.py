"""One interface for every way of drafting (small LM, n-gram lookup, ...).

A proposer sees the request's token ids so far and proposes up to ``k`` continuations. It may
keep state across rounds of one request (a KV cache); it must notice by itself when the engine
discarded some of its proposals, by comparing the ids it is given with what it has seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from onlinespec.decoding.sampling import SamplingParams


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
    source: str = "draft"  # which drafter made it (a hybrid proposer mixes several)

    def __len__(self) -> int:
        return len(self.tokens)


class Proposer(Protocol):
    """Optionally, ``uses_features = True`` plus ``observe(feature)``: the engine then hands the
    proposer the target's post-norm hidden state at the last verified position after each round."""

    name: str

    def begin(self, prompt_ids: list[int]) -> None:
        """A new request starts: drop all state of the previous one."""

    def propose(
        self,
        ids: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        with_probs: bool = False,
    ) -> Proposal:
        """Propose at most ``k`` tokens that follow ``ids``.

        Sampling (``params.temperature > 0``) proposers that draw at random must return the
        distributions they drew from in ``probs``; ``with_probs`` asks for them in greedy mode too.
        """
