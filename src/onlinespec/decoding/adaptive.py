"""Adaptive k: per step, the proposal lengths that maximise the whole batch's expected tokens per second.

For a block of ``j`` proposals a request's round emits ``1 + a_1 + a_1 a_2 + ... + a_1...a_j``
tokens in expectation (``a_i``: the chance that proposal ``i`` is accepted once the ones before it
were). A step verifies every running request in ONE target forward over ``B`` rows of ``W``
tokens (narrower blocks are padded), whose cost comes from the measured curve
(:class:`onlinespec.decoding.calibrate.CostCurve`, over batch size, width and context). So a step
picks ``W`` to maximise ``sum_r E_r(W - 1) / cost(B, W)``: at batch 1 that is the paper's best-k
rule with a measured verify cost; at a batch large enough that a wider forward costs more than
the tokens it adds, ``W = 1`` wins and the step is plain decoding, by itself, from the curve (no
fixed batch-size threshold). Before drafting, :func:`proposal_budget` asks whether speculating
pays at all at this batch size, from past statistics alone, so a step that will not speculate
does not draft either.

``a_i`` comes from measured acceptance, per draft (:class:`AdaptiveK` holds one draft's
statistics): per drafter and per confidence bin (or per step, for drafters with no confidence),
with exponentially decaying counts so the estimate follows a draft that is learning online.

Lossless: in greedy mode the engine emits the target's argmax whatever it verifies. When sampling,
choosing ``j`` from a request's own sampled confidences would bias which tokens get verified, so a
sampled request's estimates use only past statistics (never its current draws); other requests'
draws are independent of its own, so a width they pull up or down keeps its output exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onlinespec.decoding.cost_curve import CONTEXTS, CostCurve
from onlinespec.decoding.proposers.base import Proposal

BINS = 10
# Speculating must beat plain decoding by this share of the predicted rate: the curve prices the
# forward and the draft, not the verification and bookkeeping each proposal adds (a few percent of
# a step, docs/engine-batched.md), so a predicted tie is a loss.
MIN_GAIN = 0.05
# The per-step acceptance of a well-aligned draft, the most learning can hope for in :func:`could_pay`:
# arXiv 2310.07177 reports distilled drafts at alpha 0.65-0.76 and its best speedups above 0.9.
REACHABLE_ACCEPTANCE = 0.9
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

    def choose(self, proposal: Proposal, uncached: int, use_confidence: bool) -> int:
        """How many of ``proposal``'s tokens to verify (0 .. len), for one request alone."""
        row = PlanRow(proposal, self, use_confidence, uncached=uncached)
        return plan_step([row])[1][0]

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


@dataclass
class PlanRow:
    """One request of a step, as the planner sees it."""

    proposal: Proposal
    adaptive: AdaptiveK | None  # its draft's statistics; None: verify every proposal
    use_confidence: bool = False  # greedy: its draft's own confidences may inform the choice
    fixed: bool = False  # verify the whole proposal whatever it costs (a seeded sampled request)
    uncached: int = 1  # tokens of the request the target cache has not seen yet

    @property
    def flexible(self) -> bool:
        return self.adaptive is not None and not self.fixed


def expected_tokens(estimates: list[float], n: int) -> float:
    """1 + a_1 + a_1 a_2 + ... + a_1...a_n: tokens a round with ``n`` proposals emits in expectation."""
    expected, chain = 1.0, 1.0
    for a in estimates[:n]:
        chain *= a
        expected += chain
    return expected


def plan_step(rows: list[PlanRow], context: int = CONTEXTS[0]) -> tuple[int, list[int]]:
    """The block width ``W`` of one forward over ``rows``, and how many proposals each verifies.

    Flexible rows verify ``min(len, W - uncached)`` (padding is free once the forward is that
    wide); the others verify all their proposals, so ``W`` is at least their width.
    """
    if not rows:
        return 0, []
    floor = max(r.uncached + (0 if r.flexible else len(r.proposal)) for r in rows)
    top = max(r.uncached + len(r.proposal) for r in rows)
    planner = next((r.adaptive for r in rows if r.adaptive is not None), None)
    width = top
    if planner is not None and top > floor:
        estimates = [r.adaptive.estimates(r.proposal, r.use_confidence) if r.flexible else [] for r in rows]
        best_rate = -1.0
        for w in range(floor, top + 1):
            expected = sum(
                expected_tokens(e, min(len(r.proposal), w - r.uncached)) if r.flexible else 1.0 for r, e in zip(rows, estimates)
            )
            rate = expected / planner.cost(w, len(rows), context)
            if w == 1:
                rate *= 1 + MIN_GAIN
            if rate > best_rate + 1e-12:
                width, best_rate = w, rate
    return width, [len(r.proposal) if not r.flexible else max(0, min(len(r.proposal), width - r.uncached)) for r in rows]


def proposal_budget(
    adaptives: list[AdaptiveK | None], k: int, context: int = CONTEXTS[0], draft_step_seconds: float = 0.0
) -> int:
    """Before drafting: ``k`` if speculating pays at all for a batch of ``len(adaptives)`` rows,
    else 0 (a plain decoding step, nothing drafted).

    Judged from past statistics alone: the best number of proposals per request at its draft's
    measured per-step acceptance, against the cost of that wider forward at this batch size and
    of the draft steps, by at least ``MIN_GAIN``. When some number pays, all ``k`` are drafted and :func:`plan_step`, which
    sees the drafts' confidences, picks how many to verify (its choices are what keeps the later
    steps' statistics measured).
    """
    planner = next((a for a in adaptives if a is not None), None)
    if planner is None or k <= 0:
        return k
    estimates = [a.step_estimates(k) if a is not None else [1.0] * k for a in adaptives]
    return k if _speculation_pays(planner, estimates, k, context, draft_step_seconds) else 0


def could_pay(planner: AdaptiveK, batch: int, k: int, acceptance: float = REACHABLE_ACCEPTANCE, context: int = CONTEXTS[0]) -> bool:
    """Whether a draft accepted ``acceptance`` of the time at every step could beat plain decoding
    at ``batch`` rows, from the target's cost curve alone (drafting taken as free). False where
    a wider forward costs about as much as the tokens it could add (a compute-bound batch): there
    no draft pays, whatever it learns. Blocks wider than the curve measured are not judged."""
    k = min(k, planner.curve.max_width - 1)
    return _speculation_pays(planner, [[acceptance] * k] * batch, k, context, 0.0)


def _speculation_pays(planner: AdaptiveK, estimates: list[list[float]], k: int, context: int, draft_step_seconds: float) -> bool:
    """Some number of proposals ``n <= k`` per row (each row's per-step acceptance ``estimates``)
    beats plain decoding's rate by ``MIN_GAIN``."""
    batch = len(estimates)
    plain = (1 + MIN_GAIN) * batch / planner.cost(1, batch, context)
    return any(sum(expected_tokens(e, n) for e in estimates) / (planner.cost(1 + n, batch, context) + n * draft_step_seconds) > plain
               for n in range(1, k + 1))


def trim(proposal: Proposal, n: int) -> Proposal:
    if n >= len(proposal):
        return proposal
    return Proposal(
        proposal.tokens[:n],
        proposal.probs[:n] if proposal.probs is not None else None,
        proposal.forward_seconds,
        proposal.confidences[:n] if proposal.confidences is not None else None,
        proposal.drafter,
    )
