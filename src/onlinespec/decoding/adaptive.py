"""Adaptive k: per step, the proposal lengths that maximise the whole batch's expected tokens per second.

For a block of ``j`` proposals a request's round emits ``1 + a_1 + a_1 a_2 + ... + a_1...a_j``
tokens in expectation (``a_i``: the chance that proposal ``i`` is accepted once the ones before it
were). A step verifies every running request in ONE target forward over ``B`` rows of ``W``
tokens (narrower blocks are padded), whose cost comes from the measured curve
(:class:`onlinespec.decoding.calibrate.CostCurve`, over batch size, width and context). So a step
picks ``W`` to maximise ``sum_r E_r(W - 1) / cost(B, W)``: at batch 1 that is the paper's best-k
rule with a measured verify cost; at a batch large enough that a wider forward costs more than
the tokens it adds, ``W = 1`` wins and the step is plain decoding, by itself, from the curve (no
fixed batch-size threshold). Before drafting, :func:`proposal_budget` asks how many proposals pay
at this batch size, from past statistics alone, so a step drafts no more than it expects to
verify, and a step that will not speculate does not draft at all.

``a_i`` comes from measured acceptance, per draft (:class:`AdaptiveK`, in
:mod:`onlinespec.decoding.acceptance`). This module is the maths of planning; the state a step's
plan carries (the drafts' measured cost, whether the step explores) is the step planner's
(:class:`onlinespec.decoding.planner.StepPlanner`).

Lossless: in greedy mode the engine emits the target's argmax whatever it verifies. When sampling,
choosing ``j`` from a request's own sampled confidences would bias which tokens get verified, so a
sampled request's estimates use only past statistics (never its current draws); other requests'
draws are independent of its own, so a width they pull up or down keeps its output exact.
"""

from __future__ import annotations

from dataclasses import dataclass

from onlinespec.decoding.acceptance import ANY, BINS, AdaptiveK, expected_tokens
from onlinespec.decoding.cost_curve import CONTEXTS
from onlinespec.decoding.proposal import Proposal, trim

# the statistics moved to acceptance.py and trim to proposal.py: their old names still import from here
__all__ = ["ANY", "BINS", "MIN_GAIN", "REACHABLE_ACCEPTANCE", "AdaptiveK", "PlanRow", "could_pay", "expected_tokens", "plan_step",
           "proposal_budget", "trim"]

# Speculating must beat plain decoding by this share of the predicted rate: the curve prices the
# forward and the draft, not the verification and bookkeeping each proposal adds (a few percent of
# a step, docs/engine-batched.md), so a predicted tie is a loss.
MIN_GAIN = 0.05
# The per-step acceptance of a well-aligned draft, the most learning can hope for in :func:`could_pay`:
# arXiv 2310.07177 reports distilled drafts at alpha 0.65-0.76 and its best speedups above 0.9.
REACHABLE_ACCEPTANCE = 0.9


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
    adaptives: list[AdaptiveK | None], k: int, context: int = CONTEXTS[0], draft_step_seconds: float = 0.0,
    drafters: list[str | None] | None = None,
) -> int:
    """Before drafting: how many tokens each request drafts this step, for a batch of
    ``len(adaptives)`` rows: the number of proposals (at most ``k``) that maximises the batch's
    expected tokens per second, or 0 when none beats plain decoding (a plain step, nothing drafted).

    Judged from past statistics alone: each row's draft's measured per-step acceptance
    (``drafters[i]``: of that drafter's proposals only, the one whose steps cost; None: of all its
    proposals), against the cost of that wider forward at this batch size and of the draft steps,
    by at least ``MIN_GAIN``. Drafting more than that number would spend draft steps that
    :func:`plan_step`, which sees the drafts' confidences and picks how many to verify, would
    rarely use: at 2-4 rows on the Q8_0 default the head drafted k = 4 tokens a row for about one
    verified (docs/cpu-speculation.md).
    """
    planner = next((a for a in adaptives if a is not None), None)
    if planner is None or k <= 0:
        return k
    drafters = drafters or [None] * len(adaptives)
    estimates = [[1.0] * k if a is None else a.drafter_estimates(d, k) if d else a.step_estimates(k) for a, d in zip(adaptives, drafters)]
    return _best_count(planner, estimates, k, context, draft_step_seconds)


def could_pay(planner: AdaptiveK, batch: int, k: int, acceptance: float = REACHABLE_ACCEPTANCE, context: int = CONTEXTS[0]) -> bool:
    """Whether a draft accepted ``acceptance`` of the time at every step could beat plain decoding
    at ``batch`` rows, from the target's cost curve alone (drafting taken as free). False where
    a wider forward costs about as much as the tokens it could add (a compute-bound batch): there
    no draft pays, whatever it learns. Blocks wider than the curve measured are not judged."""
    k = min(k, planner.curve.max_width - 1)
    return _best_count(planner, [[acceptance] * k] * batch, k, context, 0.0) > 0


def _best_count(planner: AdaptiveK, estimates: list[list[float]], k: int, context: int, draft_step_seconds: float) -> int:
    """The number of proposals ``n <= k`` per row (each row's per-step acceptance ``estimates``)
    with the highest expected rate, if that beats plain decoding's by ``MIN_GAIN``; else 0."""
    batch = len(estimates)
    best, best_rate = 0, (1 + MIN_GAIN) * batch / planner.cost(1, batch, context)
    for n in range(1, k + 1):
        rate = sum(expected_tokens(e, n) for e in estimates) / (planner.cost(1 + n, batch, context) + n * draft_step_seconds)
        if rate > best_rate:
            best, best_rate = n, rate
    return best
