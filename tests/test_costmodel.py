"""The paper's cost model (arXiv 2310.07177, background), checked against its own worked figures."""

import pytest

from onlinespec import costmodel as cm


def test_tokens_per_round_limits():
    assert cm.expected_tokens_per_round(0.0, 5) == 1.0  # nothing accepted: the target's own token
    assert cm.expected_tokens_per_round(1.0, 5) == 6.0  # all accepted plus the bonus token
    assert cm.expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.parametrize("c, k", [(0.01, 7), (0.02, 6), (0.05, 4), (0.1, 3)])
def test_best_k_matches_paper(c, k):
    # the paper's figures: for alpha 0.6, best k = 7, 6, 4, 3 at c = 0.01, 0.02, 0.05, 0.1
    assert cm.best_k(0.6, c, k_max=20) == k


def test_low_alpha_is_slower_than_plain_decoding():
    assert cm.speedup(0.1, 4, 0.1) < 1.0
    assert cm.speedup(0.9, 4, 0.05) > 2.0


def test_speedup_is_superlinear_in_alpha():
    assert cm.speedup(0.8, 5, 0.05) > 2 * cm.speedup(0.4, 5, 0.05)


def test_verify_cost_may_depend_on_k():
    curve = {1: 1.0, 2: 1.01, 3: 1.10, 4: 1.45, 5: 1.58}.__getitem__
    assert cm.speedup(0.5, 3, 0.1, curve) == pytest.approx(cm.expected_tokens_per_round(0.5, 3) / (0.3 + 1.10))
    assert cm.best_k(0.5, 0.0, k_max=5, verify_cost=curve) < cm.best_k(0.5, 0.0, k_max=5)


def test_osd_gain_formula():
    a1, a2, k = 0.5, 0.8, 4
    expected = ((1 - a2 ** (k + 1)) * (1 - a1)) / ((1 - a2) * (1 - a1 ** (k + 1)))
    assert cm.osd_gain(a1, a2, k) == pytest.approx(expected)


@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.7, 0.95])
def test_alpha_from_tokens_per_round_inverts(alpha):
    tau = cm.expected_tokens_per_round(alpha, 4)
    assert cm.alpha_from_tokens_per_round(tau, 4) == pytest.approx(alpha, abs=1e-9)


def test_estimate_from_measurements():
    est = cm.estimate(accepted=60, rejected=40, k=3, draft_seconds_per_step=0.004,
                      target_seconds_per_step=0.040, verify_seconds_per_round=0.044)
    assert (est.alpha, est.c, est.verify_cost) == pytest.approx((0.6, 0.1, 1.1))
    assert est.predicted_speedup == pytest.approx(cm.expected_tokens_per_round(0.6, 3) / (0.3 + 1.1))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="alpha"):
        cm.expected_tokens_per_round(1.5, 3)
    with pytest.raises(ValueError, match="tokens per round"):
        cm.alpha_from_tokens_per_round(7.0, 3)
