"""The step planner: how many tokens a step drafts, and how many of them it verifies.

One owner for a step's k decisions (:class:`StepPlanner`); the engine keeps the loop and the
requests' lifecycle and asks it:

1. before drafting, once (:meth:`StepPlanner.asks`): how many tokens each request asks its
   proposer for: ``k``, never past the tokens it has left, and for a running request with adaptive
   k, never past the step's budget (:func:`~onlinespec.decoding.adaptive.proposal_budget`: ``k``
   if speculating pays at all at this batch size, from past statistics and the drafts' measured
   cost, else 0); a step that would draft nothing for too long explores instead, drafting one
   token and verifying it whatever it costs (:meth:`AdaptiveK.idle_step`);
   where the budget asks none, a greedy request with adaptive k may still draft what costs nothing
   (:meth:`StepPlanner.lookups`: prompt lookup and the suffix index), and the forward verifies
   such a copy only where its calibrated confidence pays (a long verbatim match); a seeded
   sampled request asks what its own rounds say pays, alone (:func:`own_ask`), and verifies all of it;
2. after each proposer's call (:meth:`StepPlanner.drafted`): what one draft step of it cost;
3. before each forward that verifies, once (:meth:`StepPlanner.verify`): its width and each
   request's proposals cut to the count it verifies
   (:func:`~onlinespec.decoding.adaptive.plan_step`); the batched forward is one question, and a
   joining request's forward of its own (prompt and first proposals) another.

It holds ``k``, per proposer the moving average of one batched draft step's seconds, and whether
this step explores. The maths is :mod:`onlinespec.decoding.adaptive`'s, the statistics
:mod:`onlinespec.decoding.acceptance`'s (per draft, on each request's ``adaptive``).
"""

from __future__ import annotations

from onlinespec.decoding.acceptance import AdaptiveK, expected_tokens
from onlinespec.decoding.adaptive import MIN_GAIN, PlanRow, plan_step, proposal_budget
from onlinespec.decoding.cost_curve import CONTEXTS
from onlinespec.decoding.proposal import Proposal, trim
from onlinespec.decoding.proposers.base import Proposer
from onlinespec.decoding.request import RequestState

DRAFT_COST_SMOOTHING = 0.1  # weight of a proposer call's draft-step seconds in its moving average
# A seeded sampled request's own statistics (own_ask): a weak prior, so a few rounds move them, and
# one explored proposal after this many rounds that drafted nothing.
OWN_PRIOR_WEIGHT = 2.0
OWN_EXPLORE_EVERY = 8


class StepPlanner:
    """A step's k decisions, and the state they carry from step to step."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"k (proposal length) must be >= 0, got {k}")
        self.k = k  # the most proposals per round
        self.exploring = False  # this step verifies what it drafted, paying or not (AdaptiveK.idle_step)
        self._draft_step_seconds: dict[int, float] = {}  # per proposer: one batched draft step, moving average

    def asks(self, joining: list[RequestState], decoding: list[RequestState], context: int) -> list[int]:
        """Before drafting: how many tokens each of ``joining + decoding`` asks its proposer for
        (``decoding``: the running requests, whose proposals the step's budget caps; ``context``:
        the cache columns the batched forward will attend over)."""
        budget = self._budget(decoding, context)
        return [self._ask(r, None) for r in joining] + [self._ask(r, budget) for r in decoding]

    def lookups(self, rows: list[RequestState], asks: list[int]) -> list[int]:
        """How many tokens each of ``rows`` may draft at no model cost (its proposer's
        ``propose_free``) where ``asks`` gave it none: ``k`` within its remaining tokens, for a
        greedy request with adaptive k (whose proposals :meth:`verify` judges by their confidences)."""
        return [self._ask(r, None) if ask == 0 and r.adaptive is not None and not r.fixed_k and r.params.greedy else 0
                for r, ask in zip(rows, asks)]

    def drafted(self, proposer: Proposer, seconds: float, asks: list[int]) -> None:
        """One call of ``proposer`` drafted ``asks`` tokens for its requests in ``seconds``."""
        step = seconds / max(asks)
        old = self._draft_step_seconds.get(id(proposer))
        self._draft_step_seconds[id(proposer)] = step if old is None else (1 - DRAFT_COST_SMOOTHING) * old + DRAFT_COST_SMOOTHING * step

    def verify(self, requests: list[RequestState], proposals: list[Proposal], uncached: int = 1,
               context: int = CONTEXTS[0]) -> tuple[int, list[Proposal]]:
        """Before one forward that verifies ``requests``' ``proposals`` (each with ``uncached``
        tokens of its text ahead of them): its block width, and each proposal cut to what it verifies."""
        rows = [PlanRow(p, r.adaptive, use_confidence=r.params.greedy, fixed=r.fixed_k or self.exploring, uncached=uncached)
                for r, p in zip(requests, proposals)]
        width, counts = plan_step(rows, context)
        return width, [trim(p, n) for p, n in zip(proposals, counts)]

    def _budget(self, decoding: list[RequestState], context: int) -> int:
        """The most proposals a running request with adaptive k sends this step: as many as pay at
        this batch size; one, when none pays but the drafts are due to be measured again."""
        # a greedy request looks up for free whatever the budget (lookups), so the budget prices its paid drafter alone
        paid = [r.proposer.paid_drafter if r.proposer is not None and r.params.greedy else None for r in decoding]
        budget = proposal_budget([r.adaptive if not r.fixed_k else None for r in decoding], self.k, context,
                                 self._draft_cost(decoding), paid) if decoding else self.k
        adaptive = next((r.adaptive for r in decoding if r.adaptive is not None and not r.fixed_k), None)
        self.exploring = budget == 0 and adaptive is not None and adaptive.idle_step()
        if self.exploring:  # measure the drafts again: this step drafts one token and verifies it
            budget = min(self.k, 1)
        return budget

    def _ask(self, r: RequestState, budget: int | None) -> int:
        """``k``, never past the tokens ``r`` has left, nor past ``budget`` when it has adaptive k
        (a seeded sampled request: what its own rounds say pays, :func:`own_ask`)."""
        k = min(self.k, r.stop.remaining - 1) if r.proposer is not None else 0
        if r.adaptive is not None and r.fixed_k:
            return own_ask(r, k)
        if budget is not None and r.adaptive is not None:
            k = min(k, budget)
        return k

    def _draft_cost(self, rows: list[RequestState]) -> float:
        """Seconds of one draft step of every proposer of ``rows`` (each drafts its rows in one call)."""
        return sum(self._draft_step_seconds.get(key, 0.0) for key in {id(r.proposer) for r in rows if r.proposer is not None})


def own_ask(r: RequestState, k: int) -> int:
    """How many proposals a seeded sampled request drafts (and then verifies, all of them) this
    round, from nothing but its own verified rounds: the ``j <= k`` with the best expected tokens
    per cost of a ``1 + j``-token forward at batch 1 over its own context, on the draft's measured
    curve (drafting taken as free; a tie goes to ``j = 0``), from acceptance statistics of its own
    rounds under a weak prior (:data:`OWN_PRIOR_WEIGHT`); one proposal every
    :data:`OWN_EXPLORE_EVERY` rounds that drafted nothing, so a draft judged not to pay is measured
    again. Other requests and timings never enter, so the same seed gives the same text whatever
    else is served (the fixed-k guarantee), while a draft that does not pay for this request stops
    costing it a k-wide forward every round. Lossless: the choice reads past rounds only, never
    this round's draws (docs/engine.md, adaptive k)."""
    if k <= 0:
        return 0
    own = r.own_adaptive
    if own is None:
        own = r.own_adaptive = AdaptiveK(r.adaptive.curve, prior_weight=OWN_PRIOR_WEIGHT, padded=r.adaptive.padded,
                                         explore_every=OWN_EXPLORE_EVERY)
    context = len(r.ids)
    estimates = own.step_estimates(k)
    rates = [expected_tokens(estimates, j) / own.cost(1 + j, 1, context) * (1 + MIN_GAIN if j == 0 else 1) for j in range(k + 1)]
    best = max(range(k + 1), key=lambda j: (rates[j], -j))
    if best == 0 and own.idle_step():
        return 1
    return best
