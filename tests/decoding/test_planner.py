"""The step planner answers the engine's k questions: what each request drafts, what a forward
verifies, and what the drafts cost. Requests here are stand-ins carrying only what it reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from onlinespec.decoding.acceptance import AdaptiveK
from onlinespec.decoding.cost_curve import CostCurve
from onlinespec.decoding.planner import OWN_EXPLORE_EVERY, StepPlanner
from onlinespec.decoding.proposal import Proposal

CHEAP = CostCurve({(1, 64): [1.0, 1.05, 1.1, 1.15], (8, 64): [2.0, 6.0, 6.5, 7.0]})  # pays at batch 1, not at 8


def request(adaptive=None, proposer="draft", remaining=100, fixed_k=False, greedy=True):
    proposer = SimpleNamespace(paid_drafter=None) if proposer == "draft" else proposer
    return SimpleNamespace(adaptive=adaptive, proposer=proposer, fixed_k=fixed_k, own_adaptive=None, ids=[0] * 64,
                           stop=SimpleNamespace(remaining=remaining), params=SimpleNamespace(greedy=greedy))


def test_running_requests_ask_what_pays_and_joining_ones_ask_k():
    planner, adaptive = StepPlanner(3), AdaptiveK(CHEAP)
    joining = [request(adaptive), request(adaptive, remaining=2), request(None, proposer=None)]
    assert planner.asks(joining, [request(adaptive)], 64) == [3, 1, 0, 3]  # never past remaining - 1
    crowd = [request(adaptive) for _ in range(8)] + [request(adaptive, fixed_k=True)]
    assert planner.asks(joining, crowd, 64) == [3, 1, 0] + [0] * 8 + [3]  # a seeded request plans alone (at batch 1)


def test_a_draft_step_that_costs_too_much_is_not_asked_for():
    planner, adaptive, proposer = StepPlanner(3), AdaptiveK(CHEAP), SimpleNamespace(paid_drafter=None)
    rows = [request(adaptive, proposer=proposer)]
    assert planner.asks([], rows, 64) == [3]
    planner.drafted(proposer, 3.0, [3, 1])  # one draft step: 1 s, dearer than the forward it would save
    assert planner.asks([], rows, 64) == [0]
    for _ in range(9):  # free calls: a moving average, 0.9 of the old and 0.1 of the new
        planner.drafted(proposer, 0.0, [3])
    assert planner.asks([], rows, 64) == [0]  # 0.9 ** 9 s a step: one proposal pays below 0.378 s
    planner.drafted(proposer, 0.0, [3])
    assert planner.asks([], rows, 64) == [1]  # 0.35 s a step: one proposal pays, a second would not earn its step
    for _ in range(40):
        planner.drafted(proposer, 0.0, [3])
    assert planner.asks([], rows, 64) == [3]  # nearly free (5 ms): all of them


def test_a_step_that_drafts_nothing_for_long_explores_and_verifies_all_it_drafted():
    adaptive = AdaptiveK(CostCurve({(1, 64): [1.0, 5.0, 6.0]}), explore_every=4)
    planner, rows = StepPlanner(2), [request(adaptive)]
    assert [planner.asks([], rows, 64) for _ in range(4)] == [[0], [0], [0], [1]]
    assert planner.exploring
    width, kept = planner.verify(rows, [Proposal([7], confidences=[0.01])], 1, 64)
    assert width == 2 and kept[0].tokens == [7]  # verified however little it pays
    assert planner.asks([], rows, 64) == [0] and not planner.exploring
    assert planner.verify(rows, [Proposal([7], confidences=[0.01])], 1, 64)[0] == 1  # not exploring: plain decoding


def test_where_the_budget_asks_nothing_a_greedy_request_may_still_look_up_for_free():
    planner, adaptive = StepPlanner(3), AdaptiveK(CHEAP)
    crowd = [request(adaptive) for _ in range(7)] + [request(adaptive, greedy=False), request(adaptive, fixed_k=True),
                                                      request(adaptive, remaining=2)]
    asks = planner.asks([], crowd, 64)
    assert asks == [0] * 8 + [3, 0]  # a batch of 10: no paid draft pays
    # the greedy ones look up (their copies are judged by confidence); a sampled one does not
    assert planner.lookups(crowd, asks) == [3] * 7 + [0, 0, 1]


def test_a_hybrids_paid_draft_is_priced_by_its_own_acceptance_not_by_its_free_copies():
    adaptive = AdaptiveK(CostCurve({(1, 64): [1.0, 1.1, 1.2, 1.3]}))
    for _ in range(200):  # copies accepted in full, the head's proposals rejected at once
        adaptive.update(Proposal([1, 2, 3], drafter="ngram"), 3, use_confidence=False)
        adaptive.update(Proposal([1, 2, 3], drafter="head"), 0, use_confidence=False)
    planner, hybrid = StepPlanner(3), SimpleNamespace(paid_drafter="head")
    assert planner.asks([], [request(adaptive, proposer=hybrid)], 64) == [0]  # its head would not pay (its copies draft free)
    assert planner.asks([], [request(adaptive, proposer=hybrid, greedy=False)], 64) == [3]  # sampled: no free lookups, all it drafts


def test_k_below_zero_is_refused():
    with pytest.raises(ValueError, match="k \\(proposal length\\)"):
        StepPlanner(-1)


def test_a_seeded_request_plans_from_its_own_rounds_alone():
    """Its k reads its own verified rounds only (so its text depends on its seed alone), whatever
    the draft's shared statistics say: on a curve where each verified token costs, its prior does
    not pay, it explores one proposal every OWN_EXPLORE_EVERY rounds, and its own acceptance decides."""
    steep = AdaptiveK(CostCurve({(1, 64): [1.0, 1.6, 1.9, 2.2]}))  # a 4-bit file's shape on a CPU
    for _ in range(200):  # everyone else's proposals accepted in full
        steep.update(Proposal([1, 2, 3]), 3, use_confidence=False)
    planner, mine = StepPlanner(3), request(steep, fixed_k=True, greedy=False)
    asks = [planner.asks([], [mine], 64)[0] for _ in range(OWN_EXPLORE_EVERY)]
    assert asks == [0] * (OWN_EXPLORE_EVERY - 1) + [1]
    for _ in range(4):  # its own first proposals accepted
        mine.own_adaptive.update(Proposal([5]), 1, use_confidence=False)
    assert planner.asks([], [mine], 64) == [2]  # 0.83 at the first step, its prior 0.5 after
    width, kept = planner.verify([mine], [Proposal([5, 6], confidences=[0.01, 0.01])], 1, 64)
    assert width == 3 and kept[0].tokens == [5, 6]  # verified whole, whatever else shares the forward
    for _ in range(20):  # then rejected at once
        mine.own_adaptive.update(Proposal([5, 6]), 0, use_confidence=False)
    assert planner.asks([], [mine], 64) == [0]
    assert steep.step_estimates(3)[0] > 0.9  # the shared statistics never moved it
