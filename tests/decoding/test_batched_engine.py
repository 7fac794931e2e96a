"""Many requests per step: the batched engine is lossless for every request, whatever else is in
the batch, and its adaptive k falls back to plain decoding by itself when the curve says so.

Tiny random models (mechanics only). Sampling: 3-token continuations of one prompt, each request
with its own seed (10000 + i), served in batches of 6 mixed with greedy requests and requests at
other temperatures on other prompts; chi-square against the exact target-alone distribution,
p-value > 1e-3 (the tolerance of tests/decoding/test_lossless_engine.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from onlinespec.decoding.adaptive import AdaptiveK, PlanRow, could_pay, plan_step, proposal_budget
from onlinespec.decoding.batch_cache import BatchKVCache, cache_arg
from onlinespec.decoding.cost_curve import CostCurve
from onlinespec.decoding.proposers.base import Proposal
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.proposers.feature import FeatureHeadProposer
from onlinespec.decoding.proposers.hybrid import HybridProposer
from onlinespec.decoding.proposers.ngram import NgramProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.scheduler import Scheduler
from onlinespec.decoding.speculative import SpeculativeDecoder
from tests.decoding.test_lossless_engine import NEW_TOKENS, PASS_P, SEED_BASE, exact_distribution, fit
from tests.drafts.test_feature_head import random_head

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 4, 2], [5, 5, 0, 3], [2], [1, 4, 2, 1, 4, 2, 1], [3, 3, 3, 1, 2, 0, 4, 5, 1, 2, 3, 4, 0, 1], [0, 1]]
LENGTHS = [24, 10, 30, 5, 17, 12]


def _params(**sampling) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, ignore_eos=True, **sampling) for n in LENGTHS]


def _proposers(target, draft):
    head = random_head(target)
    return {
        "draft-lm": (DraftModelProposer(draft), None),
        "self-draft": (DraftModelProposer(target), None),  # every proposal accepted: long rounds
        "ngram": (NgramProposer(), None),
        "head": (FeatureHeadProposer(head), None),
        "hybrid+adaptive": (HybridProposer(FeatureHeadProposer(head), min_ngram=1), AdaptiveK([1.0, 1.1, 1.3, 1.4])),
    }


@pytest.mark.parametrize("name", ["draft-lm", "self-draft", "ngram", "head", "hybrid+adaptive"])
@pytest.mark.parametrize("max_batch", [2, 6])
def test_greedy_output_of_every_request_is_the_targets(tiny_target, tiny_draft, name, max_batch):
    """Prompts of 1-14 tokens, 5-30 new tokens each, more requests than slots (they join and
    leave between steps), prompts prefilled in chunks of 4 tokens while others decode."""
    expected = [SpeculativeDecoder(tiny_target).generate(p, sp).token_ids for p, sp in zip(PROMPTS, _params())]
    proposer, adaptive = _proposers(tiny_target, tiny_draft)[name]
    decoder = SpeculativeDecoder(tiny_target, None, proposer, k=3, adaptive_k=adaptive, prefill_chunk=4)
    outs = decoder.generate_many(PROMPTS, _params(), max_batch=max_batch)
    assert [o.token_ids for o in outs] == expected
    if name != "draft-lm":
        assert sum(o.stats.accepted for o in outs) > 0  # multi-token rounds were exercised


def test_target_alone_batched_equals_one_at_a_time(tiny_target):
    alone = SpeculativeDecoder(tiny_target, prefill_chunk=2)
    one_by_one = [alone.generate(p, sp).token_ids for p, sp in zip(PROMPTS, _params())]
    assert [o.token_ids for o in alone.generate_many(PROMPTS, _params(), max_batch=4)] == one_by_one


def test_a_seed_gives_the_same_text_whatever_else_is_in_the_batch(tiny_target, tiny_draft):
    decoder = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=3,
                                 adaptive_k=AdaptiveK([1.0, 1.1, 1.3, 1.4]))
    mine = SamplingParams(max_new_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    alone = decoder.generate([1, 4, 2], mine).token_ids
    others = [SamplingParams(max_new_tokens=n, temperature=t, seed=s, ignore_eos=True) for n, t, s in [(5, 0.0, None), (30, 0.7, 1), (9, 1.0, None)]]
    for companions in (others, others[:1], others[::-1]):
        outs = decoder.generate_many([[1, 4, 2]] + PROMPTS[: len(companions)], [mine] + companions, max_batch=4)
        assert outs[0].token_ids == alone


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)], ids=["t1.0", "warped"])
def test_sampled_output_in_a_mixed_batch_follows_the_targets_distribution(tiny_target, tiny_draft, sampling, chi_square):
    """N = 3000 requests of the tested prompt (seeds 10000..; the unbatched tests' N), each served in a batch of 6 with
    greedy requests and requests at temperature 1.3 on other prompts; p-value > 1e-3."""
    prompt = [1, 4, 2, 1, 4]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, **sampling)
    exact = exact_distribution(tiny_target, prompt, params)
    head = random_head(tiny_target)
    decoder = SpeculativeDecoder(tiny_target, None, HybridProposer(FeatureHeadProposer(head), min_ngram=1), k=3,
                                 adaptive_k=AdaptiveK([1.0, 1.1, 1.3, 1.4]))
    prompts, plist, tested = [], [], []
    for i in range(3000):
        tested.append(len(prompts))
        prompts.append(prompt)
        plist.append(SamplingParams(max_new_tokens=NEW_TOKENS, seed=SEED_BASE + i, ignore_eos=True, **sampling))
        if i % 4 == 0:  # companions: other prompts, other lengths, greedy and hotter sampling
            prompts.append(PROMPTS[i % len(PROMPTS)])
            plist.append(SamplingParams(max_new_tokens=1 + i % 7, temperature=0.0 if i % 8 else 1.3, ignore_eos=True))
    outs = decoder.generate_many(prompts, plist, max_batch=6)
    counts: dict[tuple, int] = {}
    for i in tested:
        counts[tuple(outs[i].token_ids)] = counts.get(tuple(outs[i].token_ids), 0) + 1
    accepted = sum(outs[i].stats.accepted for i in tested)
    rejected = sum(outs[i].stats.rejected for i in tested)
    assert accepted > 300 and rejected > 300, (accepted, rejected)
    assert sum(c for x, c in counts.items() if exact.get(x, 0.0) == 0) == 0
    p_value, stat, df = fit(counts, exact, chi_square)
    assert p_value > PASS_P, (p_value, stat, df)


def test_the_target_alone_shares_a_step_with_requests_whose_head_reads_hidden_states(tiny_target):
    """A server mixes `"draft": "none"` requests with drafted ones in one forward: the hidden
    states the head reads come back for every row, and the undrafted rows must not choke on them."""
    head = FeatureHeadProposer(random_head(tiny_target))
    decoder = SpeculativeDecoder(tiny_target, None, head, k=3)
    expected = [SpeculativeDecoder(tiny_target).generate(p, sp).token_ids for p, sp in zip(PROMPTS, _params())]
    scheduler = Scheduler(decoder.engine, 6)
    requests = [decoder.request(p, sp, proposer=head if i % 2 else None) for i, (p, sp) in enumerate(zip(PROMPTS, _params()))]
    for i, r in enumerate(requests):
        if i % 2 == 0:
            r.proposer, r.draft_state = None, None  # the target alone
        scheduler.submit(r)
    while scheduler.has_work:
        scheduler.step()
    assert [r.error for r in requests] == [None] * len(requests)
    assert [r.ids[len(r.prompt_ids):] for r in requests] == expected


def test_a_swap_offered_between_two_takes_is_never_lost(tiny_draft, tiny_target):
    proposer = DraftModelProposer(tiny_draft, version="v0")
    proposer.swap_model(tiny_target, "v1")
    assert proposer.take_swap() and proposer.version == "v1" and proposer.model is tiny_target
    assert not proposer.take_swap()  # nothing new
    proposer.swap_model(tiny_draft, "v2")
    proposer.swap_model(tiny_target, "v3")  # the newest offer wins
    assert proposer.take_swap() and proposer.version == "v3"


# ---- adaptive k over the batch ------------------------------------------------------------------


def test_plain_decoding_when_wider_forwards_do_not_pay_at_a_large_batch(tiny_target, tiny_draft):
    """A made-up curve: at batch 1 a wider forward is nearly free, at batch 4 it costs 3x a
    width-1 forward. With 4 requests in flight every step is plain decoding (width 1, nothing
    drafted); one request alone speculates."""
    costs = {(1, 64): [1.0, 1.02, 1.04, 1.06], (4, 64): [1.5, 4.5, 4.6, 4.7]}
    adaptive = AdaptiveK(CostCurve(costs))
    proposer = DraftModelProposer(tiny_target)  # the target itself: everything it proposes is accepted
    asked = []  # the number of requests each draft call drafted for
    propose = proposer.propose
    proposer.propose = lambda batch: asked.append(len(batch)) or propose(batch)
    decoder = SpeculativeDecoder(tiny_target, None, proposer, k=3, adaptive_k=adaptive)
    steps = []
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 4
    decoder.generate_many([[1, 2], [3, 4], [5, 0], [2, 2]], params, max_batch=4, on_step=steps.append)
    full = [s for s in steps if s.batch == 4]
    assert full and all(s.width == 1 and s.proposed == 0 for s in full)
    assert len(asked) <= 4, asked  # drafted for joining requests only (their first round), never for the full batch
    steps.clear()
    out = decoder.generate_many([[1, 2]], params[:1], max_batch=1, on_step=steps.append)[0]
    assert out.stats.accepted > 0 and max(s.width for s in steps) > 1


def test_plan_step_pads_every_flexible_row_to_the_chosen_width():
    adaptive = AdaptiveK([1.0, 1.0, 1.0, 1.0, 1.0], prior_weight=1.0)  # wider is free: verify everything
    rows = [PlanRow(Proposal([1, 2, 3], confidences=[0.9] * 3, drafter="head"), adaptive, True),
            PlanRow(Proposal([1], confidences=[0.9], drafter="head"), adaptive, True),
            PlanRow(Proposal([4, 4], drafter="ngram"), None)]  # no statistics: verifies all its proposals
    width, counts = plan_step(rows)
    assert width == 4 and counts == [3, 1, 2]


def test_a_fixed_row_sets_the_floor_of_the_width():
    costly = AdaptiveK([1.0, 5.0, 5.0, 5.0], prior_weight=1.0)  # wider never pays for a flexible row
    rows = [PlanRow(Proposal([1, 2], confidences=[0.9, 0.9], drafter="head"), costly, True),
            PlanRow(Proposal([3, 3, 3]), costly, fixed=True)]  # a seeded sampled request
    width, counts = plan_step(rows)
    assert width == 4 and counts == [2, 3]  # the flexible row rides along for free once it is that wide


def test_proposal_budget_follows_the_batch_size():
    curve = CostCurve({(1, 64): [1.0, 1.05, 1.1], (8, 64): [2.0, 6.0, 6.5]})
    adaptive = AdaptiveK(curve)
    assert proposal_budget([adaptive], 3) == 3
    assert proposal_budget([adaptive] * 8, 3) == 0


def test_a_step_drafts_only_as_many_tokens_as_pay():
    """Q8_0's kernels on this CPU make a second token nearly free and later ones dear: drafting k = 4
    for one verified proposal spent three draft steps for nothing (docs/cpu-speculation.md)."""
    curve = CostCurve({(2, 64): [14.0, 15.0, 30.0, 45.0, 60.0]})
    adaptive = AdaptiveK(curve)
    assert proposal_budget([adaptive] * 2, 4) == 1
    assert proposal_budget([adaptive] * 2, 4, draft_step_seconds=20.0) == 0  # a draft step dearer than what it earns


def test_could_pay_asks_the_curve_whether_any_draft_could_pay_at_a_batch_size():
    """Measured on llama.cpp here (docs/online-learning.md): at 8 requests a forward over 2 tokens
    costs 1.8x one over 1, and no per-step acceptance below 0.95 pays for it."""
    curve = CostCurve({(1, 64): [1.0, 1.3, 1.6], (8, 64): [2.0, 3.66, 5.3]})
    adaptive = AdaptiveK(curve)
    assert could_pay(adaptive, 1, 4) and could_pay(adaptive, 4, 4)
    assert not could_pay(adaptive, 8, 4) and could_pay(adaptive, 8, 4, acceptance=1.0)
    assert could_pay(adaptive, 8, 8, acceptance=0.9) is False  # blocks wider than the curve measured are not judged


def test_cost_curve_interpolates_batch_and_context():
    curve = CostCurve({(1, 64): [1.0, 2.0], (1, 512): [3.0, 4.0], (4, 64): [5.0, 6.0], (4, 512): [7.0, 8.0]})
    assert curve.cost(1, 1, 64) == 1.0 and curve.cost(4, 2, 512) == 8.0
    assert curve.cost(1, 1, 288) == pytest.approx(2.0)  # halfway in context
    assert curve.cost(2, 1, 64) == pytest.approx(1.0 + 4.0 / 3)  # a third of the way in batch
    assert curve.cost(8, 1, 64) == pytest.approx(1.0 + 4.0 * 7 / 3)  # past the last batch: the line through the last two
    assert CostCurve({(2, 64): [3.0]}).cost(6, 1) == pytest.approx(9.0)  # one batch size measured: scaled
    assert curve.padded(1, 1) == 1 and CostCurve({(1, 64): [2.0, 1.0]}).padded(1, 1) == 2


# ---- the cache ------------------------------------------------------------------------------------


@torch.inference_mode()
def test_rows_with_holes_compute_what_each_request_computes_alone(tiny_llama):
    """Three requests of different lengths in one cache, blocks of different widths, holes left by
    rejected columns, then compaction: each row's logits equal a plain forward of its real tokens."""
    model = tiny_llama(5, vocab_size=11, hidden_size=32, num_layers=2)
    batch = BatchKVCache(model.config)
    tokens = {"a": [1, 2, 3, 4, 5], "b": [6, 7], "c": [8, 9, 10, 1, 2, 3, 4, 5, 6]}
    for name, ids in tokens.items():
        own = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([ids]), **cache_arg(model, own))
        batch.add(name, own)
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        widths = [1 + (step + i) % 3 for i in range(len(batch.rows))]
        blocks = [torch.randint(0, 11, (w,), generator=generator).tolist() for w in widths]
        input_ids, positions, mask = batch.inputs(blocks, max(widths))
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **cache_arg(model, batch.cache)).logits
        kept = []
        for b, (name, block) in enumerate(zip(batch.rows, blocks)):
            alone = model(input_ids=torch.tensor([tokens[name] + block])).logits[0, -len(block):]
            torch.testing.assert_close(logits[b, : len(block)], alone, rtol=1e-4, atol=1e-4)
            keep = 1 + (step + b) % len(block)  # a prefix survives; the rest become holes
            tokens[name] += block[:keep]
            kept.append(keep)
        batch.commit(max(widths), kept)
        if step == 2:
            batch.remove(["b"])
        if step == 4:
            batch.compact()
            assert batch.width == max(batch.lengths)
    assert batch.lengths == [len(tokens[name]) for name in batch.rows]


def test_a_draft_judged_not_to_pay_is_measured_again(tiny_target):
    """On a steep verify curve (as llama.cpp's on a 2-core CPU) adaptive k stops drafting; once in
    ``explore_every`` such steps it drafts one token and verifies it, so a draft that improved
    (or a cold one) is measured again instead of being frozen out for good."""
    steep = AdaptiveK([1.0, 5.0, 6.0], explore_every=8)
    decoder = SpeculativeDecoder(tiny_target, None, NgramProposer(max_ngram=2), k=2, adaptive_k=steep)
    out = decoder.generate([1, 2, 1, 2, 1, 2, 1], SamplingParams(max_new_tokens=40))
    assert 0 < out.stats.proposed <= 40 // 8 + 2, out.stats.proposed  # a proposal in (about) every 8th step, one token each
    assert any(rate.judged > 0 for rate in steep.rates.values()), "what verification judged was recorded"
