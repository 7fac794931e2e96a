"""Measured acceptance, per draft: the statistics adaptive k plans from (:mod:`onlinespec.decoding.adaptive`).

For a block of ``j`` proposals a request's round emits ``1 + a_1 + a_1 a_2 + ... + a_1...a_j``
tokens in expectation (``a_i``: the chance that proposal ``i`` is accepted once the ones before it
were; :func:`expected_tokens`). ``a_i`` comes from measured acceptance, per draft
(:class:`AdaptiveK` holds one draft's statistics): per drafter and per confidence bin (or per
step, for drafters with no confidence), with exponentially decaying counts so the estimate
follows a draft that is learning online. A drafter that can draft several ways reads them too
(:class:`~onlinespec.decoding.proposers.hybrid.HybridProposer`), so this module sits below the
proposers and knows nothing of planning a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onlinespec.decoding.cost_curve import CONTEXTS, CostCurve
from onlinespec.decoding.proposal import Proposal

BINS = 10
ANY = "*"  # statistics of a draft's proposals whatever drafter made them (planning before drafting)


@dataclass
class _Rate:
    accepted: float = 0.0
    judged: float = 0.0


@dataclass
class AdaptiveK:
    """One draft's measured acceptance, and the verify-cost curve of the target it drafts for."""

    verify_costs: CostCurve | list[float]  # a measured curve, or seconds over 1, 2, ... tokens (one request)
    prior_weight: float = 8.0  # pseudo-counts behind each prior
    decay: float = 0.998  # per judged proposal: the estimate follows about the last 500
    padded: bool = True  # blocks are padded to the cheapest wider width (CostCurve.padded)
    rates: dict[tuple[str, int], _Rate] = field(default_factory=dict)
    # After this many steps in a row that drafted nothing, one step drafts one token and verifies
    # it: estimates stop changing while nothing is verified, so without it a draft judged not to
    # pay (a cold one, or on a target whose verify cost is steep) would never be measured again,
    # even once it has learned. It costs one 2-token forward in this many steps (on the
    # llama.cpp curve of docs/backends.md, about 1%).
    explore_every: int = 64
    _idle: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.verify_costs, CostCurve):
            if not self.verify_costs:
                raise ValueError("adaptive k needs the measured verify-cost curve (one cost per block width)")
            self.verify_costs = CostCurve.from_widths(list(self.verify_costs))

    @property
    def curve(self) -> CostCurve:
        return self.verify_costs

    def cost(self, width: int, batch: int = 1, context: int = CONTEXTS[0]) -> float:
        curve = self.curve
        return curve.padded_cost(batch, width, context) if self.padded else curve.cost(batch, width, context)

    def estimates(self, proposal: Proposal, use_confidence: bool) -> list[float]:
        return [self._estimate(*self._key(proposal, i, use_confidence)) for i in range(len(proposal))]

    def step_estimates(self, n: int) -> list[float]:
        """Acceptance of steps 1..n of a proposal not drafted yet (any drafter, no confidence)."""
        return [self._estimate((f"{ANY}@step", i), 0.5) for i in range(n)]

    def drafter_estimates(self, drafter: str, n: int) -> list[float]:
        """Acceptance of steps 1..n of a proposal ``drafter`` has not drafted yet (no confidence)."""
        return [self._estimate((f"{drafter}@step", i), 0.5) for i in range(n)]

    def idle_step(self) -> bool:
        """A step is about to draft nothing: True when it should explore instead (see ``explore_every``)."""
        self._idle += 1
        if self._idle < self.explore_every:
            return False
        self._idle = 0
        return True

    def update(self, proposal: Proposal, n_accepted: int, use_confidence: bool) -> None:
        """Record what verification judged: proposals up to and including the first rejection."""
        for i in range(min(len(proposal), n_accepted + 1)):
            for key in {self._key(proposal, i, use_confidence)[0], (f"{proposal.drafter}@step", i), (f"{ANY}@step", i)}:
                rate = self.rates.setdefault(key, _Rate())
                rate.accepted = rate.accepted * self.decay + (i < n_accepted)
                rate.judged = rate.judged * self.decay + 1

    def _estimate(self, key: tuple[str, int], prior: float) -> float:
        rate = self.rates.get(key, _Rate())
        return (rate.accepted + self.prior_weight * prior) / (rate.judged + self.prior_weight)

    @staticmethod
    def _key(proposal: Proposal, i: int, use_confidence: bool) -> tuple[tuple[str, int], float]:
        if use_confidence and proposal.confidences is not None:
            c = proposal.confidences[i]
            return (proposal.drafter, min(int(c * BINS), BINS - 1)), c
        return (f"{proposal.drafter}@step", i), 0.5


def expected_tokens(estimates: list[float], n: int) -> float:
    """1 + a_1 + a_1 a_2 + ... + a_1...a_n: tokens a round with ``n`` proposals emits in expectation."""
    expected, chain = 1.0, 1.0
    for a in estimates[:n]:
        chain *= a
        expected += chain
    return expected
