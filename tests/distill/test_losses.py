"""Distillation losses against hand-computed values and known identities."""

import math

import pytest
import torch

from onlinespec.distill.losses import LOSSES, SparseTeacher, distill_loss

P = torch.tensor([[0.5, 0.3, 0.2]])
Q = torch.tensor([[0.2, 0.5, 0.3]])
LOGIT_P, LOGIT_Q = P.log(), Q.log()  # logits whose softmax is exactly P and Q


def hand_kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a.tolist()[0], b.tolist()[0]))


def test_forward_and_reverse_kl_match_hand_computation():
    assert distill_loss("fkl", LOGIT_Q, LOGIT_P).item() == pytest.approx(hand_kl(P, Q), rel=1e-5)
    assert distill_loss("rkl", LOGIT_Q, LOGIT_P).item() == pytest.approx(hand_kl(Q, P), rel=1e-5)


def test_tvd_is_one_minus_acceptance():
    # TV(p, q) = 1 - sum min(p, q) = 1 - alpha (arXiv 2310.07177, background)
    tvd = distill_loss("tvd", LOGIT_Q, LOGIT_P).item()
    assert tvd == pytest.approx(0.5 * (P - Q).abs().sum().item(), rel=1e-5)
    assert tvd == pytest.approx(1 - torch.minimum(P, Q).sum().item(), rel=1e-5)


def test_jsd_hand_value_symmetry_and_bounds():
    m = 0.5 * (P + Q)
    expected = 0.5 * hand_kl(P, m) + 0.5 * hand_kl(Q, m)
    assert distill_loss("jsd", LOGIT_Q, LOGIT_P, beta=0.5).item() == pytest.approx(expected, rel=1e-5)
    assert distill_loss("jsd", LOGIT_P, LOGIT_Q, beta=0.5).item() == pytest.approx(expected, rel=1e-5)
    assert 0 < expected < math.log(2)
    b = 0.1
    m = b * P + (1 - b) * Q
    skewed = b * hand_kl(P, m) + (1 - b) * hand_kl(Q, m)
    assert distill_loss("jsd", LOGIT_Q, LOGIT_P, beta=b).item() == pytest.approx(skewed, rel=1e-5)


@pytest.mark.parametrize("name", LOSSES)
def test_zero_when_student_equals_teacher(name):
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    assert distill_loss(name, logits, logits).item() == pytest.approx(0.0, abs=1e-6)


def test_temperature_softens_both_sides():
    hot = distill_loss("fkl", LOGIT_Q, LOGIT_P, temperature=2.0).item()
    p2, q2 = (LOGIT_P / 2).softmax(-1), (LOGIT_Q / 2).softmax(-1)
    assert hot == pytest.approx(hand_kl(p2, q2), rel=1e-5)


def test_mask_keeps_only_selected_positions():
    gen = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    mask = torch.tensor([1, 0, 1])
    kept = distill_loss("fkl", student[[0, 2]], teacher[[0, 2]])
    assert distill_loss("fkl", student, teacher, mask=mask).item() == pytest.approx(kept.item(), rel=1e-6)


@pytest.mark.parametrize("name", LOSSES)
def test_sparse_teacher_with_full_support_equals_full_logits(name):
    gen = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    logprobs = teacher.log_softmax(-1)
    top = logprobs.topk(6, dim=-1)
    sparse = SparseTeacher(top.indices, top.values)
    assert distill_loss(name, student, sparse).item() == pytest.approx(distill_loss(name, student, teacher).item(), abs=1e-5)


@pytest.mark.parametrize("name", LOSSES)
def test_sparse_teacher_keeps_the_tail_mass_and_bounds_the_full_loss(name):
    gen = torch.Generator().manual_seed(3)
    student = torch.randn(4, 50, generator=gen, requires_grad=True)
    teacher = torch.randn(4, 50, generator=gen) * 3
    top = teacher.log_softmax(-1).topk(8, dim=-1)
    sparse_loss = distill_loss(name, student, SparseTeacher(top.indices, top.values))
    # Coarse-graining never increases a divergence (data processing inequality), and the
    # tail is a bucket of its own: the loss is not that of a renormalised top-K.
    assert 0 < sparse_loss.item() <= distill_loss(name, student, teacher).item() + 1e-6
    sparse_loss.backward()
    assert torch.isfinite(student.grad).all() and student.grad.abs().sum() > 0


def test_bad_arguments_say_what_to_fix():
    with pytest.raises(ValueError, match="unknown distillation loss"):
        distill_loss("kl", LOGIT_Q, LOGIT_P)
    with pytest.raises(ValueError, match="beta"):
        distill_loss("jsd", LOGIT_Q, LOGIT_P, beta=1.0)
    top = LOGIT_P.log_softmax(-1).topk(2, dim=-1)
    with pytest.raises(ValueError, match="temperature 1"):
        distill_loss("fkl", LOGIT_Q, SparseTeacher(top.indices, top.values), temperature=2.0)
