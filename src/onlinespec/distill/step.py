"""One distillation step of a draft on recorded target distributions: batch, forward, loss, update.

The draft runs over each record's tokens (teacher-forced on the request's final text) and is
compared with the target's stored top-K distribution at each recorded position ``t``, using the
draft's logits at ``t - 1`` (the ones that predict the token at ``t``). Only the hidden states of
those positions go through the output head, so a 49k-word head costs no more than it must.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from onlinespec.distill.losses import LOSSES, SparseTeacher, bucket_log_probs, distill_loss
from onlinespec.distill.records import DistillRecord


@dataclass(frozen=True)
class DistillConfig:
    loss: str = "fkl"  # fkl | rkl | jsd | tvd
    temperature: float = 1.0
    beta: float = 0.5  # JSD mixing weight
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:  # refused when configured, not at the first update
        if self.loss not in LOSSES:
            raise ValueError(f"unknown distillation loss {self.loss!r}: use one of {', '.join(LOSSES)}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"the distillation temperature must be > 0, got {self.temperature}")
        if not 0.0 < self.beta < 1.0:
            raise ValueError(f"the JSD beta must lie in (0, 1), got {self.beta}")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L], right-padded
    attention_mask: torch.Tensor  # [B, L]
    rows: torch.Tensor  # [N] record index of each recorded position
    predictors: torch.Tensor  # [N] index t - 1 of the logits that predict position t
    teacher: SparseTeacher  # [N, K]


def collate(records: Sequence[DistillRecord], pad_id: int = 0) -> Batch:
    if not records:
        raise ValueError("no records to train on")
    length = max(len(r.token_ids) for r in records)
    input_ids = torch.full((len(records), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(records), length), dtype=torch.long)
    for i, r in enumerate(records):
        input_ids[i, : len(r.token_ids)] = torch.tensor(r.token_ids)
        attention_mask[i, : len(r.token_ids)] = 1
    rows = torch.cat([torch.full((len(r),), i) for i, r in enumerate(records)])
    predictors = torch.cat([torch.tensor(r.positions) - 1 for r in records])
    teacher = SparseTeacher(torch.cat([r.top_ids for r in records]), torch.cat([r.top_logprobs for r in records]))
    return Batch(input_ids, attention_mask, rows, predictors, teacher)


def student_logits(draft: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """The draft's logits at the predicting positions ``t - 1``: ``[N, V]``."""
    hidden = draft.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    return draft.get_output_embeddings()(hidden[batch.rows, batch.predictors])


def batch_loss(draft: PreTrainedModel, batch: Batch, config: DistillConfig) -> torch.Tensor:
    logits = student_logits(draft, batch)
    return distill_loss(config.loss, logits, batch.teacher, temperature=config.temperature, beta=config.beta)


def distill_step(
    draft: PreTrainedModel, optimizer: torch.optim.Optimizer, records: Sequence[DistillRecord], config: DistillConfig
) -> float:
    """One optimizer step on ``records``; returns the loss before the step."""
    return optimizer_step(draft, optimizer, lambda: batch_loss(draft, collate(records), config), config.max_grad_norm)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: Callable[[], torch.Tensor],
                   max_grad_norm: float) -> float:
    """The one optimizer step every trainer here takes (draft LMs and feature heads, offline and
    online): ``loss()`` computed in training mode, gradients clipped to ``max_grad_norm``, the
    model left in eval mode for serving. Returns the loss before the step."""
    model.train()
    value = loss()
    optimizer.zero_grad(set_to_none=True)
    value.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    optimizer.step()
    model.eval()
    return float(value.detach())


@torch.inference_mode()
def evaluate(draft: PreTrainedModel, records: Sequence[DistillRecord], config: DistillConfig) -> dict[str, float]:
    """On held-out records: the loss; ``agreement``, how often the draft's argmax is the target's
    (greedy acceptance of a first proposal); and ``alpha`` = sum min(p, q), the acceptance
    probability of a sampled proposal (over the stored top-K plus the tail bucket)."""
    batch = collate(records)
    logits = student_logits(draft, batch)
    loss = distill_loss(config.loss, logits, batch.teacher, temperature=config.temperature, beta=config.beta)
    log_p, log_q = bucket_log_probs(logits, batch.teacher)
    return {
        "loss": float(loss),
        "agreement": float((logits.argmax(-1) == batch.teacher.top_ids[:, 0]).float().mean()),
        "alpha": float(torch.minimum(log_p.exp(), log_q.exp()).sum(-1).mean()),
    }
