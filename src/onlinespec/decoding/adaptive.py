"""Adaptive k: per round, send the number of proposals that maximises expected tokens per second.

For a block of ``j`` proposals the expected number of tokens a round emits is
``1 + a_1 + a_1 a_2 + ... + a_1...a_j`` (``a_i``: the chance that proposal ``i`` is accepted once
the ones before it were), and the round costs one target forward over ``u + j`` tokens (``u``:
tokens the target cache has not seen, usually 1). The cost comes from the measured verify-cost
curve (:func:`onlinespec.decoding.calibrate.forward_costs`, after padding); ``a_i`` from measured
acceptance: per drafter and per confidence bin (or per step, for drafters with no confidence),
with exponentially decaying counts so the estimate follows a draft that is learning online.

Lossless: in greedy mode the engine emits the target's argmax whatever it verifies. When sampling,
choosing ``j`` from the drafts' own sampled confidences would bias which tokens get verified, so
there the choice uses only the past statistics (never the current draws).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onlinespec.decoding.proposers.base import Proposal

BINS = 10


@dataclass
class _Rate:
    accepted: float = 0.0
    judged: float = 0.0


@dataclass
class AdaptiveK:
    verify_costs: list[float]  # seconds of a target forward over 1, 2, ... tokens (padded)
    prior_weight: float = 8.0  # pseudo-counts behind each prior
    decay: float = 0.998  # per judged proposal: the estimate follows about the last 500
    padded: bool = True  # blocks are padded to the cheapest wider width (calibrate.padding_plan)
    rates: dict[tuple[str, int], _Rate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.verify_costs:
            raise ValueError("adaptive k needs the measured verify-cost curve (one cost per block width)")
        # After padding a block never costs more than any wider one.
        costs = list(self.verify_costs)
        for width in range(len(costs) - 2, -1, -1) if self.padded else ():
            costs[width] = min(costs[width], costs[width + 1])
        self._costs = costs

    def cost(self, width: int) -> float:
        return self._costs[min(width, len(self._costs)) - 1]

    def estimates(self, proposal: Proposal, use_confidence: bool) -> list[float]:
        out = []
        for i in range(len(proposal)):
            key, prior = self._key(proposal, i, use_confidence)
            rate = self.rates.get(key, _Rate())
            out.append((rate.accepted + self.prior_weight * prior) / (rate.judged + self.prior_weight))
        return out

    def choose(self, proposal: Proposal, uncached: int, use_confidence: bool) -> int:
        """How many of ``proposal``'s tokens to verify (0 .. len)."""
        best, best_rate, expected, chain = 0, 1.0 / self.cost(uncached), 1.0, 1.0
        for j, a in enumerate(self.estimates(proposal, use_confidence), start=1):
            chain *= a
            expected += chain
            rate = expected / self.cost(uncached + j)
            if rate > best_rate:
                best, best_rate = j, rate
        return best

    def update(self, proposal: Proposal, n_accepted: int, use_confidence: bool) -> None:
        """Record what verification judged: proposals up to and including the first rejection."""
        for i in range(min(len(proposal), n_accepted + 1)):
            key, _ = self._key(proposal, i, use_confidence)
            rate = self.rates.setdefault(key, _Rate())
            rate.accepted = rate.accepted * self.decay + (i < n_accepted)
            rate.judged = rate.judged * self.decay + 1

    @staticmethod
    def _key(proposal: Proposal, i: int, use_confidence: bool) -> tuple[tuple[str, int], float]:
        if use_confidence and proposal.confidences is not None:
            c = proposal.confidences[i]
            return (proposal.source, min(int(c * BINS), BINS - 1)), c
        return (f"{proposal.source}@step", i), 0.5


def trim(proposal: Proposal, n: int) -> Proposal:
    if n >= len(proposal):
        return proposal
    return Proposal(
        proposal.tokens[:n],
        proposal.probs[:n] if proposal.probs is not None else None,
        proposal.forward_seconds,
        proposal.confidences[:n] if proposal.confidences is not None else None,
        proposal.source,
    )
