"""End to end: speculative decoding with real (tiny, random) models is lossless.

Sampling: the engine generates 3 tokens (k = 2) N times, each call with its own seed, and the
empirical distribution of the 3-token continuations is compared with the target-alone distribution,
computed exactly by enumerating all 6^3 continuations through ``logits_to_probs`` with the same
``SamplingParams``. Chi-square goodness of fit, bins of expected count < 5 pooled; seeds
``SEED_BASE + i``; a correct engine must give p-value > 1e-3, and any continuation the target
rules out (probability exactly 0 after top-k / top-p) must never appear.

Greedy: speculative output equals the target-alone output token for token.
"""

from __future__ import annotations

import pytest
import torch

import onlinespec.decoding.engine as engine_module
from onlinespec.decoding.autoregressive import autoregressive_decoder
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.proposers.ngram import NgramProposer
from onlinespec.decoding.sampling import SamplingParams, logits_to_probs
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.decoding.verify import Verdict, residual_distribution, verify_sampling

pytestmark = pytest.mark.usefixtures("one_thread")

N_RUNS = 3000  # 216 outcomes (6 tokens, 3 new): bins below 5 expected are pooled; 1,500 already reject a wrong residual (below)
NEW_TOKENS = 3
K = 2
SEED_BASE = 10_000
PASS_P = 1e-3
PROMPT = [1, 4, 2]
NGRAM_PROMPT = [1, 4, 2, 1, 4, 2, 1]  # repeats, so the n-gram proposer has something to copy

PLAIN = dict(temperature=1.0)
WARPED = dict(temperature=0.7, top_k=4, top_p=0.9)


@torch.inference_mode()
def exact_distribution(target, prompt: list[int], params: SamplingParams, n: int = NEW_TOKENS) -> dict:
    """P(continuation) for every continuation of ``n`` tokens the target allows (probability > 0:
    the others are left out, and read as 0), by the target alone (no cache)."""
    dist = {(): 1.0}
    for _ in range(n):
        prefixes = list(dist)
        logits = target(input_ids=torch.tensor([prompt + list(x) for x in prefixes])).logits[:, -1]
        probs = logits_to_probs(logits, params).double()
        dist = {
            prefix + (token,): dist[prefix] * float(probs[row, token])
            for row, prefix in enumerate(prefixes)
            for token in probs[row].nonzero().flatten().tolist()
        }
    return dist


def empirical(decoder, prompt, n_runs: int, **sampling) -> tuple[dict, dict]:
    counts: dict[tuple, int] = {}
    totals = {"proposed": 0, "accepted": 0, "rejected": 0, "rounds": 0}
    for i in range(n_runs):
        params = SamplingParams(max_new_tokens=NEW_TOKENS, seed=SEED_BASE + i, ignore_eos=True, **sampling)
        out = decoder.generate(prompt, params)
        assert len(out.token_ids) == NEW_TOKENS and out.stats.finish_reason == "length"
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        for key in totals:
            totals[key] += getattr(out.stats, key)
    return counts, totals


def fit(counts: dict, exact: dict, chi_square) -> float:
    keys = sorted(set(exact) | set(counts))
    return chi_square([counts.get(x, 0) for x in keys], [exact.get(x, 0.0) for x in keys])


@pytest.mark.parametrize("sampling", [PLAIN, WARPED], ids=["t1.0", "t0.7-topk4-topp0.9"])
def test_draft_model_sampling_matches_target_distribution(tiny_target, tiny_draft, sampling, chi_square):
    """3-token continuations ~ target alone. N = 3000 runs, seeds 10000.., p-value > 1e-3."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, **sampling)
    exact = exact_distribution(tiny_target, PROMPT, params)
    decoder = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=K)
    counts, totals = empirical(decoder, PROMPT, N_RUNS, **sampling)
    # the run exercised every path: accepted proposals, rejections, full acceptance (bonus)
    assert totals["rejected"] > N_RUNS / 10 and totals["accepted"] > N_RUNS / 2, totals
    impossible = sum(c for x, c in counts.items() if exact.get(x, 0.0) == 0)
    assert impossible == 0, "emitted a continuation the target rules out"
    p_value, stat, df = fit(counts, exact, chi_square)
    assert p_value > PASS_P, (p_value, stat, df)


@pytest.mark.parametrize("sampling", [PLAIN, WARPED], ids=["t1.0", "t0.7-topk4-topp0.9"])
def test_ngram_sampling_matches_target_distribution(tiny_target, sampling, chi_square):
    """Point-mass proposals (n-gram lookup): still the target's distribution. N = 3000, p > 1e-3."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, **sampling)
    exact = exact_distribution(tiny_target, NGRAM_PROMPT, params)
    decoder = SpeculativeDecoder(tiny_target, None, NgramProposer(max_ngram=3), k=K)
    counts, totals = empirical(decoder, NGRAM_PROMPT, N_RUNS, **sampling)
    assert totals["proposed"] > N_RUNS and totals["accepted"] > N_RUNS / 10 and totals["rejected"] > N_RUNS / 10, totals
    assert sum(c for x, c in counts.items() if exact.get(x, 0.0) == 0) == 0
    p_value, stat, df = fit(counts, exact, chi_square)
    assert p_value > PASS_P, (p_value, stat, df)


def test_the_end_to_end_check_catches_a_wrong_residual(tiny_target, tiny_draft, chi_square, monkeypatch):
    """Power: the same harness, with the engine's correction drawn from p instead of
    norm(max(0, p - q)), is rejected with p-value < 1e-6 (N = 1500, seeds 10000..: p about 4e-14;
    the tests above draw 3000)."""

    def wrong_residual(proposals, draft_probs, target_probs, generator=None):
        verdict = verify_sampling(proposals, draft_probs, target_probs, generator)
        if verdict.n_accepted == len(proposals):
            return verdict
        # redraw the correction from p itself (a classic bug)
        return Verdict(verdict.n_accepted, int(torch.multinomial(target_probs[verdict.n_accepted], 1, generator=generator)))

    monkeypatch.setattr(engine_module, "verify_sampling", wrong_residual)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, **PLAIN)
    exact = exact_distribution(tiny_target, PROMPT, params)
    decoder = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=K)
    counts, _ = empirical(decoder, PROMPT, 1500, **PLAIN)
    p_value, stat, df = fit(counts, exact, chi_square)
    assert p_value < 1e-6, (p_value, stat, df)


def test_residual_distribution_by_hand():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([[0.2, 0.6, 0.2]])
    torch.testing.assert_close(residual_distribution(p, q, [1], 0), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, None, [0], 0), torch.tensor([0.0, 0.6, 0.4]))


# ---- greedy: identical to the target alone --------------------------------------------------------

GREEDY_PROMPTS = [[0], [3, 3], [1, 4, 2, 5], [2, 0, 1, 2, 0, 1, 2], [5, 4, 3, 2, 1, 0, 5, 4]]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculative_equals_autoregressive(tiny_target, tiny_draft, k):
    reference = autoregressive_decoder(tiny_target)
    decoders = {
        "draft": SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=k),
        "self-draft": SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_target), k=k),
        "ngram": SpeculativeDecoder(tiny_target, None, NgramProposer(), k=k),
    }
    rejected = 0
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for prompt in GREEDY_PROMPTS:
        expected = reference.generate(prompt, params)
        assert expected.stats.rounds == 20 and len(expected.token_ids) == 20
        for name, decoder in decoders.items():
            out = decoder.generate(prompt, params)
            assert out.token_ids == expected.token_ids, (name, prompt)
            assert out.prompt_ids == prompt
            assert out.stats.finish_reason == "length"
            assert out.stats.new_tokens == 20
            assert out.stats.accepted + out.stats.rounds == 20  # every round: accepted + 1 token
            rejected += out.stats.rejected
            if name == "self-draft":  # the target drafting for itself is always right
                assert out.stats.rejected == 0 and out.stats.acceptance_rate == 1.0
                assert out.stats.rounds == -(-20 // (k + 1))
    assert rejected > 0  # the rollback path was exercised


def test_decoder_is_reusable_across_requests(tiny_target, tiny_draft):
    """One decoder (and its draft's KV cache) serves many requests; each equals a fresh decode."""
    shared = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=3)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for prompt in GREEDY_PROMPTS + GREEDY_PROMPTS[::-1]:
        fresh = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=3)
        assert shared.generate(prompt, params).token_ids == fresh.generate(prompt, params).token_ids


def test_sampling_is_reproducible_per_seed(tiny_target, tiny_draft):
    decoder = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=3)

    def run(seed):
        return decoder.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed, ignore_eos=True))

    assert run(1).token_ids == run(1).token_ids
    assert len({tuple(run(s).token_ids) for s in range(5)}) > 1


def test_perfect_draft_is_always_accepted_when_sampling(tiny_target):
    """Draft == target: p = q, every proposal is accepted (up to float round-off in p/q)."""
    decoder = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_target), k=3)
    accepted = proposed = 0
    for seed in range(20):
        out = decoder.generate(PROMPT, SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed, ignore_eos=True))
        accepted, proposed = accepted + out.stats.accepted, proposed + out.stats.proposed
    assert accepted / proposed > 0.98


def test_k0_and_no_proposer_are_plain_decoding(tiny_target, tiny_draft):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    plain = autoregressive_decoder(tiny_target).generate(PROMPT, params)
    k0 = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=0).generate(PROMPT, params)
    assert k0.token_ids == plain.token_ids
    assert plain.stats.rounds == 8 and plain.stats.proposed == 0
    with pytest.raises(ValueError, match="k"):
        SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=-1)


def test_exact_distribution_sums_to_one(tiny_target):
    for sampling in (PLAIN, WARPED):
        dist = exact_distribution(tiny_target, PROMPT, SamplingParams(**sampling))
        assert sum(dist.values()) == pytest.approx(1.0) and all(v > 0 for v in dist.values())
    assert len(exact_distribution(tiny_target, PROMPT, SamplingParams(**PLAIN))) == 6**NEW_TOKENS
    # the warp really cuts: some continuations are impossible (left out)
    assert len(exact_distribution(tiny_target, PROMPT, SamplingParams(**WARPED))) < 6**NEW_TOKENS


def test_bfloat16_greedy_speculative_equals_autoregressive(tiny_llama):
    """bf16 target and draft: the engine runs in the models' dtype and stays token-identical."""
    target = tiny_llama(seed=0, vocab_size=32, hidden_size=32).to(torch.bfloat16)
    draft = tiny_llama(seed=3, vocab_size=32, hidden_size=32).to(torch.bfloat16)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    for prompt in ([1, 2, 3], [7, 8, 9, 10]):
        expected = autoregressive_decoder(target).generate(prompt, params).token_ids
        out = SpeculativeDecoder(target, None, DraftModelProposer(draft), k=3).generate(prompt, params)
        assert out.token_ids == expected
    sampled = SpeculativeDecoder(target, None, DraftModelProposer(draft), k=3).generate(
        [1, 2, 3], SamplingParams(max_new_tokens=10, temperature=0.8, seed=0, ignore_eos=True))
    assert len(sampled.token_ids) == 10
