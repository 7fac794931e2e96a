"""The acceptance math of speculative decoding, checked statistically and by hand.

Statistical tests run ``verify_sampling`` N = 20,000 times on hand-made target rows ``p_1..p_{k+1}``
and draft rows ``q_1..q_k`` (vocabularies of 5 and 6 tokens, fixed seeds) and compare, with a
chi-square goodness-of-fit test, what was emitted with what speculative decoding promises:

- the first emitted token ~ p_1;
- given that proposal 1 was accepted, the second emitted token ~ p_2;
- given that all k proposals were accepted, the bonus token ~ p_{k+1};
- proposal 1 is accepted with probability alpha = sum_x min(p_1(x), q_1(x)).

Tolerance: a correct sampler must give p-value > 1e-3 on every check (with the fixed seeds the
measured p-values are far above that); each deliberately broken sampler below must be caught by
its check with p-value < 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from onlinespec.decoding.sampling import SamplingParams, logits_to_probs, sample
from onlinespec.decoding.verify import Verdict, verify_greedy, verify_sampling

pytestmark = pytest.mark.usefixtures("one_thread")

N_TRIALS = 20_000
PASS_P = 1e-3  # a correct sampler must not be rejected at this level
DETECT_P = 1e-6  # a broken sampler must be rejected at this level

# ---- hand-made distributions ------------------------------------------------------------------

# V = 5, k = 2. alpha_1 = sum min(p_1, q_1) = 0.50, alpha_2 = 0.45: plenty of rejections and of
# full acceptances (about 0.5 * 0.45 * N bonus tokens). p_2 != p_3 so a bonus from the wrong row shows.
P_5 = torch.tensor(
    [
        [0.10, 0.30, 0.05, 0.40, 0.15],  # p_1
        [0.35, 0.15, 0.25, 0.05, 0.20],  # p_2
        [0.05, 0.10, 0.60, 0.05, 0.20],  # p_3: bonus
    ]
)
Q_5 = torch.tensor(
    [
        [0.50, 0.20, 0.15, 0.10, 0.05],  # q_1
        [0.05, 0.45, 0.10, 0.30, 0.10],  # q_2
    ]
)

# V = 6, k = 3, with zeros in both p and q (a top-k/top-p cut on either side).
P_6 = torch.tensor(
    [
        [0.00, 0.25, 0.25, 0.10, 0.40, 0.00],
        [0.30, 0.00, 0.20, 0.20, 0.10, 0.20],
        [0.10, 0.10, 0.10, 0.50, 0.00, 0.20],
        [0.40, 0.05, 0.05, 0.05, 0.05, 0.40],
    ]
)
Q_6 = torch.tensor(
    [
        [0.30, 0.30, 0.00, 0.20, 0.20, 0.00],
        [0.10, 0.40, 0.30, 0.00, 0.10, 0.10],
        [0.20, 0.30, 0.00, 0.30, 0.10, 0.10],
    ]
)


# ---- deliberately broken samplers (each must be detected) -------------------------------------


def _sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _broken(proposals, draft_probs, target_probs, generator, *, ratio="p/q", residual="p-q", bonus_row=None):
    k = len(proposals)
    for i, x in enumerate(proposals):
        p, q = float(target_probs[i, x]), float(draft_probs[i, x])
        accept = min(1.0, p / q) if ratio == "p/q" else min(1.0, q / p if p > 0 else 1.0)
        if float(torch.rand((), generator=generator)) >= accept:
            if residual == "p-q":
                res = (target_probs[i] - draft_probs[i]).clamp_min(0)
            else:
                res = target_probs[i]
            return Verdict(i, _sample(res / res.sum(), generator))
    return Verdict(k, _sample(target_probs[k if bonus_row is None else bonus_row(k)], generator))


def residual_is_p(proposals, draft_probs, target_probs, generator=None):
    """Broken: after a rejection, resample from p instead of norm(max(0, p - q))."""
    return _broken(proposals, draft_probs, target_probs, generator, residual="p")


def inverted_ratio(proposals, draft_probs, target_probs, generator=None):
    """Broken: accept with probability min(1, q/p) instead of min(1, p/q)."""
    return _broken(proposals, draft_probs, target_probs, generator, ratio="q/p")


def bonus_from_p_k(proposals, draft_probs, target_probs, generator=None):
    """Broken: when all k are accepted, draw the bonus from p_k instead of p_{k+1}."""
    return _broken(proposals, draft_probs, target_probs, generator, bonus_row=lambda k: k - 1)


def reference_sampler(proposals, draft_probs, target_probs, generator=None):
    """The test's own correct implementation: shows the harness passes a right sampler."""
    return _broken(proposals, draft_probs, target_probs, generator)


# ---- the experiment -----------------------------------------------------------------------------


def run_trials(sampler, p: torch.Tensor, q: torch.Tensor | None, seed: int, fixed: list[int] | None = None):
    """Run the sampler N_TRIALS times; return the emitted-token statistics the checks need.

    ``q`` given: proposals are drawn x_i ~ q_i afresh each trial. ``q`` None: the proposals are the
    point masses ``fixed`` (an n-gram proposer), passed with ``draft_probs=None``.
    """
    k, vocab = p.shape[0] - 1, p.shape[1]
    generator = torch.Generator().manual_seed(seed)
    if q is not None:
        drawn = torch.multinomial(q, N_TRIALS, replacement=True, generator=generator).T.tolist()
    first = torch.zeros(vocab)
    second_given_first_accepted = torch.zeros(vocab)
    bonus = torch.zeros(vocab)
    first_accepted = 0
    for t in range(N_TRIALS):
        proposals = drawn[t] if q is not None else fixed
        verdict = sampler(proposals, q, p, generator)
        assert 0 <= verdict.n_accepted <= k
        emitted = proposals[: verdict.n_accepted] + [verdict.next_token]
        first[emitted[0]] += 1
        if verdict.n_accepted >= 1:
            first_accepted += 1
            second_given_first_accepted[emitted[1]] += 1
        if verdict.n_accepted == k:
            bonus[verdict.next_token] += 1
    return {
        "first": first,
        "second": second_given_first_accepted,
        "bonus": bonus,
        "first_accepted": first_accepted,
    }


def pvalues(stats, p: torch.Tensor, q: torch.Tensor | None, fixed: list[int] | None, chi_square) -> dict[str, float]:
    k = p.shape[0] - 1
    out = {
        "first": chi_square(stats["first"], p[0])[0],
        "second": chi_square(stats["second"], p[1])[0],
        "bonus": chi_square(stats["bonus"], p[k])[0],
    }
    # acceptance of proposal 1: binomial with alpha = sum min(p_1, q_1) (point mass: p_1(x_1))
    alpha = float(torch.minimum(p[0], q[0]).sum()) if q is not None else float(p[0, fixed[0]])
    z = (stats["first_accepted"] - N_TRIALS * alpha) / math.sqrt(N_TRIALS * alpha * (1 - alpha))
    out["alpha"] = math.erfc(abs(z) / math.sqrt(2))
    return out


CASES = {"V5_k2": (P_5, Q_5), "V6_k3": (P_6, Q_6)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("sampler", [verify_sampling, reference_sampler], ids=["verify_sampling", "reference"])
def test_sampling_follows_target_distribution(case, sampler, chi_square):
    """First token ~ p_1, second | first accepted ~ p_2, bonus ~ p_{k+1}, P(accept 1) = alpha.

    Seed 1234, N = 20,000; every check must give p-value > 1e-3.
    """
    p, q = CASES[case]
    stats = run_trials(sampler, p, q, seed=1234)
    assert stats["bonus"].sum() > 500, "too few full acceptances to test the bonus token"
    pv = pvalues(stats, p, q, None, chi_square)
    assert min(pv.values()) > PASS_P, pv


@pytest.mark.parametrize(
    "proposals", [[3, 0], [1, 2]], ids=["likely", "unlikely"]
)
def test_point_mass_proposals_follow_target_distribution(proposals, chi_square):
    """``draft_probs=None`` (deterministic proposer): accept x with probability p(x), else resample
    from p with x removed. Same four checks; seed 99, N = 20,000, p-value > 1e-3 each."""
    p = P_5
    stats = run_trials(verify_sampling, p, None, seed=99, fixed=proposals)
    pv = pvalues(stats, p, None, proposals, chi_square)
    assert stats["first_accepted"] > 500
    assert min(pv.values()) > PASS_P, pv


def test_point_mass_rejection_never_emits_the_rejected_token():
    """After rejecting point-mass proposal x, the correction is drawn from p without x."""
    generator = torch.Generator().manual_seed(2)
    for _ in range(2000):
        verdict = verify_sampling([3], None, P_5[:2], generator)
        if verdict.n_accepted == 0:
            assert verdict.next_token != 3


@pytest.mark.parametrize(
    "sampler, caught_by",
    [(residual_is_p, "first"), (inverted_ratio, "first"), (bonus_from_p_k, "bonus")],
    ids=["residual_is_p", "inverted_ratio", "bonus_from_p_k"],
)
def test_broken_samplers_are_detected(sampler, caught_by, chi_square):
    """The harness has the power to catch real bugs: each broken sampler fails its check with
    p-value < 1e-6 (seed 1234, N = 20,000, the V=5, k=2 distributions)."""
    stats = run_trials(sampler, P_5, Q_5, seed=1234)
    pv = pvalues(stats, P_5, Q_5, None, chi_square)
    assert pv[caught_by] < DETECT_P, pv


def test_k0_sampling_draws_from_first_row(chi_square):
    """No proposals: the round's one token comes straight from p_1 (seed 7, N = 20,000, p > 1e-3)."""
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(5)
    for _ in range(N_TRIALS):
        verdict = verify_sampling([], None, P_5[:1], generator)
        assert verdict.n_accepted == 0
        counts[verdict.next_token] += 1
    assert chi_square(counts, P_5[0])[0] > PASS_P


def test_sampling_never_emits_a_token_the_target_rules_out():
    """Tokens with p = 0 (cut by top-k/top-p) never come out, whatever the draft proposes."""
    generator = torch.Generator().manual_seed(3)
    p = P_6
    for _ in range(3000):
        proposals = torch.multinomial(Q_6, 1, generator=generator).flatten().tolist()
        verdict = verify_sampling(proposals, Q_6, p, generator)
        emitted = proposals[: verdict.n_accepted] + [verdict.next_token]
        for i, token in enumerate(emitted):
            assert p[i, token] > 0, (i, token, emitted)


def test_sampling_is_reproducible_with_a_seed():
    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        return [verify_sampling([0, 1], Q_5, P_5, generator) for _ in range(200)]

    assert run(5) == run(5)
    assert run(5) != run(6)


# ---- greedy -------------------------------------------------------------------------------------


def _logits(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


@pytest.mark.parametrize(
    "proposals, argmaxes, expected",
    [
        ([2, 4, 1], [2, 4, 1, 5], Verdict(3, 5)),  # all accepted: bonus = argmax of row k+1
        ([2, 4, 1], [2, 3, 1, 5], Verdict(1, 3)),  # mismatch at 2: correction = argmax of row 2
        ([2, 4, 1], [0, 4, 1, 5], Verdict(0, 0)),  # first proposal wrong
        ([2, 4, 1], [2, 4, 0, 5], Verdict(2, 0)),  # last proposal wrong
        ([3], [3, 2], Verdict(1, 2)),  # k = 1
        ([], [4], Verdict(0, 4)),  # k = 0: plain greedy step
    ],
)
def test_verify_greedy(proposals, argmaxes, expected):
    assert verify_greedy(proposals, _logits(argmaxes)) == expected


def test_verify_greedy_does_not_accept_after_a_mismatch():
    """Proposal 3 matches its row's argmax, but proposal 2 did not: only 1 accepted."""
    assert verify_greedy([1, 1, 1], _logits([1, 0, 1, 1])) == Verdict(1, 0)


# ---- logits_to_probs ------------------------------------------------------------------------------


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_temperature():
    logits = torch.tensor([0.0, math.log(2.0)])
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0)), torch.tensor([1 / 3, 2 / 3]))
    # T = 0.5 doubles the logits: odds 1:4
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=0.5)), torch.tensor([0.2, 0.8]))
    # T = 2 halves them: odds 1:sqrt(2)
    r = math.sqrt(2.0)
    torch.testing.assert_close(
        logits_to_probs(logits, SamplingParams(temperature=2.0)), torch.tensor([1 / (1 + r), r / (1 + r)])
    )


def test_top_k_keeps_the_k_largest_renormalized():
    logits = torch.tensor([1.0, 3.0, 0.0, 2.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    expected = torch.zeros(4)
    expected[[1, 3]] = torch.tensor([3.0, 2.0]).softmax(-1)
    torch.testing.assert_close(probs, expected)
    # top_k >= V: no cut
    full = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=4))
    torch.testing.assert_close(full, logits.softmax(-1))
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=9)), logits.softmax(-1))


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.3, [1]),  # 0.5 alone already reaches 0.3
        (0.7, [1, 3]),  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the crossing token 3 is kept
        (0.85, [1, 3, 0]),  # 0.8 < 0.85: token 0 (0.15) crosses it
        (0.97, [0, 1, 2, 3]),  # 0.95 < 0.97: all four
        (1.0, [0, 1, 2, 3]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_top_p(top_p, kept):
    # unsorted on purpose: token 1 (0.5) > token 3 (0.3) > token 0 (0.15) > token 2 (0.05)
    base = [0.15, 0.5, 0.05, 0.3]
    probs = logits_to_probs(_probs_logits(base), SamplingParams(temperature=1.0, top_p=top_p))
    expected = torch.zeros(4)
    expected[kept] = torch.tensor([base[i] for i in kept])
    torch.testing.assert_close(probs, expected / expected.sum())


def test_top_k_then_top_p_on_the_renormalized_distribution():
    """top-k first; top-p then measures mass within the k survivors (Hugging Face's order)."""
    base = [0.5, 0.3, 0.15, 0.05]
    # top_k=3 -> [0.526, 0.316, 0.158]; top_p=0.82: 0.526 < 0.82 <= 0.842 -> keep {0, 1}.
    # Without the renormalization 0.5 + 0.3 = 0.8 < 0.82 would also keep token 2.
    probs = logits_to_probs(_probs_logits(base), SamplingParams(temperature=1.0, top_k=3, top_p=0.82))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_temperature_applies_before_top_p():
    # probs at T=1: [0.6, 0.4]; at T=0.5: [0.692, 0.308]: top_p=0.65 keeps only token 0
    logits = _probs_logits([0.6, 0.4])
    params = SamplingParams(temperature=0.5, top_p=0.65)
    torch.testing.assert_close(logits_to_probs(logits, params), torch.tensor([1.0, 0.0]))


def test_logits_to_probs_works_row_by_row():
    logits = torch.stack([_probs_logits([0.15, 0.5, 0.05, 0.3]), _probs_logits([0.05, 0.05, 0.6, 0.3])])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.625, 0.0, 0.375]))
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 0.0, 2 / 3, 1 / 3]))
    assert probs.dtype == torch.float32


def test_logits_to_probs_upcasts_half_precision():
    probs = logits_to_probs(torch.tensor([0.0, 1.0], dtype=torch.bfloat16), SamplingParams(temperature=1.0))
    assert probs.dtype == torch.float32


# ---- SamplingParams -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"top_p": float("nan")}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"stop_strings": ("ok", "")}, "stop strings must be non-empty"),
        ({"stop_strings": ""}, "stop strings must be non-empty"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_stop_string_list_becomes_a_tuple():
    params = SamplingParams(stop_strings=["a", "b"])  # what a CLI option with several values gives
    assert params.stop_strings == ("a", "b")
    hash(params)


def test_sampling_params_defaults_and_normalization():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.3).greedy
    assert SamplingParams(stop_strings="END").stop_strings == ("END",)


# ---- the chi-square helper itself ---------------------------------------------------------------------


def test_chi_square_helper(chi_square):
    p, stat, df = chi_square([10, 10, 20], [0.25, 0.25, 0.5])
    assert (p, stat, df) == (pytest.approx(1.0), pytest.approx(0.0), 2)
    # stat = 4 with df = 1: p = P(|Z| > 2) = erfc(sqrt(2))
    p, stat, df = chi_square([60, 40], [0.5, 0.5])
    assert (stat, df) == (pytest.approx(4.0), 1)
    assert p == pytest.approx(math.erfc(math.sqrt(2.0)))
    # stat = 2 with df = 2: p = exp(-1)
    p, stat, df = chi_square([110, 90, 200], [0.25, 0.25, 0.5])
    assert (stat, df) == (pytest.approx(2.0), 2)
    assert p == pytest.approx(math.exp(-1.0))
    # an outcome of probability 0 is impossible
    assert chi_square([1, 9, 0], [0.0, 0.5, 0.5])[0] == 0.0
    # small bins pooled: 3 bins of expected 2 pooled into one of expected 6
    _, _, df = chi_square([100, 94, 2, 2, 2], [0.5, 0.47, 0.01, 0.01, 0.01])
    assert df == 2


def test_a_temperature_too_small_to_divide_by_is_greedy():
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=1e-38).temperature == 0.0
    assert not SamplingParams(temperature=1e-4).greedy


def test_a_draw_of_exactly_zero_never_accepts_a_token_the_target_gives_probability_zero(monkeypatch):
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])  # the target never writes token 0
    q = torch.tensor([[1.0, 0.0]])  # the draft always proposes it
    monkeypatch.setattr(torch, "rand", lambda *shape, generator=None, **kw: torch.zeros(*shape, **kw))  # u = 0 exactly (the sampler draws too)
    verdict = verify_sampling([0], q, p, None)
    assert verdict.n_accepted == 0 and verdict.next_token == 1


def test_the_sampler_follows_its_distribution_and_never_draws_a_zero(chi_square, monkeypatch):
    """The one draw every sampled token comes from (inverse CDF in float64): unnormalised weights
    with zeros among them, 20,000 draws, chi-square p > 1e-3, no zero-weight token ever; and where
    the uniform draw meets the total, the last token that can be drawn."""
    weights = torch.tensor([0.0, 2.0, 0.0, 5.0, 0.5, 2.5, 0.0])
    generator = torch.Generator().manual_seed(5)
    draws = torch.tensor([sample(weights, generator) for _ in range(20_000)])
    counts = torch.bincount(draws, minlength=len(weights))
    assert counts[weights == 0].sum() == 0
    p_value, stat, df = chi_square(counts.tolist(), (weights / weights.sum()).tolist())
    assert p_value > 1e-3, (p_value, stat, df)
    monkeypatch.setattr(torch, "rand", lambda *shape, generator=None, **kw: torch.ones(*shape, **kw))  # u = the total
    assert sample(weights, None) == 5
