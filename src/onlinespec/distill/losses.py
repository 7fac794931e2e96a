"""Distillation losses as pure functions (arXiv 2310.07177, section 4.1): FKL, RKL, generalized JSD, TVD.

Every loss compares the teacher (target) distribution ``p`` with the student (draft)
distribution ``q_theta`` position by position, and averages over the positions a mask keeps.

The teacher comes either as full logits ``[N, V]`` or as a sparse top-K record (what the
verification trace stores): ``top_ids [N, K]`` and ``top_logprobs [N, K]`` (log-softmax at
temperature 1). A sparse teacher's remaining mass ``1 - sum(exp(top_logprobs))`` is not dropped:
both distributions are compared over K + 1 buckets, the K tokens and "everything else" (the
student's mass outside the K tokens goes to the same bucket). That is the exact divergence of the
coarse-grained distributions, a lower bound of the full one that is tight when K covers the mass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("fkl", "rkl", "jsd", "tvd")


@dataclass(frozen=True)
class SparseTeacher:
    top_ids: torch.Tensor  # [N, K] int64
    top_logprobs: torch.Tensor  # [N, K] float, log-softmax at temperature 1


Teacher = torch.Tensor | SparseTeacher  # full logits [N, V], or a sparse top-K record


def distill_loss(
    name: str,
    student_logits: torch.Tensor,
    teacher: Teacher,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """The loss ``name`` (one of :data:`LOSSES`), averaged over the masked positions."""
    log_p, log_q = bucket_log_probs(student_logits, teacher, temperature)
    if name == "fkl":
        per_position = kl(log_p, log_q)
    elif name == "rkl":
        per_position = kl(log_q, log_p)
    elif name == "jsd":
        per_position = generalized_jsd(log_p, log_q, beta)
    elif name == "tvd":
        per_position = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    else:
        raise ValueError(f"unknown distillation loss {name!r}: use one of {LOSSES}")
    return masked_mean(per_position, mask)


def kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per position, from log-probabilities ``[N, B]`` (0 log 0 = 0)."""
    return F.kl_div(log_b, log_a, reduction="none", log_target=True).sum(-1)


def generalized_jsd(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q.

    beta -> 0 approaches 0 from the forward-KL side; beta = 0.5 is the symmetric JSD. beta must
    lie strictly in (0, 1): at the ends the divergence is identically zero.
    """
    if not 0.0 < beta < 1.0:
        raise ValueError(f"JSD beta must lie in (0, 1), got {beta}")
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1 - beta))
    return beta * kl(log_p, log_m) + (1 - beta) * kl(log_q, log_m)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def bucket_log_probs(student_logits: torch.Tensor, teacher: Teacher, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student log-probabilities over the same buckets: all V tokens, or K + 1."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_q = F.log_softmax(student_logits.float() / temperature, -1)
    if isinstance(teacher, torch.Tensor):
        return F.log_softmax(teacher.float() / temperature, -1), log_q
    if temperature != 1.0:
        raise ValueError(
            "a sparse top-K teacher is stored at temperature 1; its tail cannot be re-tempered: "
            "use temperature 1.0 or full teacher logits"
        )
    log_p_top = teacher.top_logprobs.float()
    log_q_top = log_q.gather(-1, teacher.top_ids)
    return _with_rest(log_p_top), _with_rest(log_q_top)


def _with_rest(log_top: torch.Tensor) -> torch.Tensor:
    """Append the bucket "every other token": log(1 - sum(exp(log_top))), kept finite."""
    covered = torch.logsumexp(log_top, -1, keepdim=True).exp().clamp_max(1 - 1e-7)  # round-off can pass 1
    return torch.cat([log_top, torch.log1p(-covered)], -1)
