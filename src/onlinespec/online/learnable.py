"""What the online learner needs from a draft it trains: :class:`LearnableDraft`.

A learnable draft offers a private copy to train (the serving one is never touched), a training
objective on replay-buffer records (the examples a batch is drawn from, and one optimizer step
on a batch), the gate's metrics on held-out records, and a strict load of published weights.
Two kinds implement it: a draft language model (a Hugging Face causal LM distilled record by
record, :mod:`onlinespec.distill.step`) and a feature head (trained along chains of the target's
features, :mod:`onlinespec.drafts.train`). :func:`learnable` picks the one for a model: the only
place that asks what kind of draft it is.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from onlinespec.decoding.feature_head import FeatureHead, frequent_vocab
from onlinespec.distill.records import DistillRecord
from onlinespec.distill.step import DistillConfig, distill_step, evaluate
from onlinespec.drafts.train import ChainConfig, chain_task, head_metrics, pool_metrics
from onlinespec.weights import load_weights


@dataclass
class Objective:
    examples: list  # what a batch is drawn from: records (a draft LM) or chain starts (a head)
    step: Callable[[torch.nn.Module, torch.optim.Optimizer, list], float]  # one optimizer step; the loss


class LearnableDraft(Protocol):
    def copy(self, model: torch.nn.Module) -> torch.nn.Module:
        """A private copy to train (it may share frozen tensors with ``model``)."""

    def objective(self, records: Sequence[DistillRecord], positions: str, depth: int, config: DistillConfig) -> Objective:
        """Training on ``records`` (``positions``: the recorder's position policy; ``depth``: chain length)."""

    def metrics(self, model: torch.nn.Module, records: Sequence[DistillRecord], config: DistillConfig,
                between: Callable[[], None] = lambda: None, per_position: bool = False, replay: bool = False) -> dict:
        """loss, agreement and alpha on held-out ``records`` (the gate's figures); ``between()`` runs
        between the pieces it is computed in (where the learner may hand the engine its turn back).
        ``per_position``: also ``alphas``, each position's alpha, where the draft can tell them.
        ``replay``: also ``replayed`` and each record's ``requests`` [accepted, judged], what the
        hybrid proposer serving with this draft accepts over the records, where the draft can be
        replayed without the target (``replays``)."""

    replays: bool  # whether metrics(replay=True) gives the replayed figures
    pool: Callable[[list[dict]], dict] | None  # several groups' metrics -> those over all their records, or None

    def load(self, model: torch.nn.Module, state: dict[str, torch.Tensor], label: str) -> None:
        """Load published weights strictly (a ValueError, naming ``label``, if they do not fit)."""

    def adapt(self, model: torch.nn.Module, records: Sequence[DistillRecord]) -> None:
        """Fit a private copy's fixed choices to the traffic in ``records`` before it trains."""

    def cold(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` started from nothing (it trains at the warm-up's learning rate)."""


class _Strict:
    replays = False
    pool = None  # figures of several groups of records -> the figures over all of them (None: measure the whole again)

    def load(self, model, state, label):
        load_weights(model, state, label)

    def adapt(self, model, records):
        pass

    def cold(self, model):
        return False


class DraftLM(_Strict):
    def copy(self, model):
        return copy.deepcopy(model)

    def objective(self, records, positions, depth, config):
        return Objective(list(records), lambda model, optimizer, batch: distill_step(model, optimizer, batch, config))

    def metrics(self, model, records, config, between=lambda: None, per_position=False, replay=False):
        return evaluate(model, records, config)  # one batch: a draft LM's held-out records are few and short (no per-position figures)


class HeadDraft(_Strict):
    replays = True  # the target's features are recorded: a head's proposals can be replayed exactly
    pool = staticmethod(pool_metrics)

    def copy(self, model):
        return model.clone()

    def objective(self, records, positions, depth, config):
        task = chain_task(records, positions, ChainConfig(depth=depth))
        return Objective(task.starts.tolist(), lambda model, optimizer, batch: task.step(model, optimizer, batch, config))

    def metrics(self, model, records, config, between=lambda: None, per_position=False, replay=False):
        return head_metrics(model, records, config, between=between, per_position=per_position, replay=replay)

    def cold(self, model):
        return model.config.vocab_from_traffic

    def adapt(self, model, records):
        """A fresh head's vocabulary: the tokens the served text (prompts and the target's
        answers) used most, and the ones it always keeps (:func:`frequent_vocab`)."""
        if not model.config.vocab_from_traffic or not records:
            return
        counts = torch.bincount(torch.tensor([t for r in records for t in r.token_ids], dtype=torch.long),
                                minlength=model.config.vocab_size or model.out_weight.shape[0])
        model.choose_vocab(frequent_vocab(counts, len(model.vocab_ids), model.config.keep_ids))


def learnable(model: torch.nn.Module) -> LearnableDraft:
    """The :class:`LearnableDraft` for ``model``."""
    return HeadDraft() if isinstance(model, FeatureHead) else DraftLM()
