"""A distillation run a long warm-up can trust: AdamW, warm-up then cosine decay, gradient
clipping, a progress bar, atomic safetensors checkpoints with metadata, and exact resume.

Batches are drawn from a permutation of the records seeded by (seed, epoch), so a run stopped
at step s and resumed sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from onlinespec.distill.loop import run_steps
from onlinespec.distill.records import DistillRecord
from onlinespec.distill.step import DistillConfig, distill_step
from onlinespec.weights import load_weights, unique_tensors


@dataclass
class TrainConfig:
    steps: int
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    checkpoint_every: int = 200
    seed: int = 0
    distill: DistillConfig = field(default_factory=DistillConfig)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class Trainer:
    """Distil ``draft`` on ``records``; checkpoints go to ``out_dir`` (resumed from if present)."""

    def __init__(
        self,
        draft: PreTrainedModel,
        records: Sequence[DistillRecord],
        out_dir: str | Path,
        config: TrainConfig,
        metadata: dict | None = None,
        step_fn: Callable[[torch.nn.Module, torch.optim.Optimizer, list, DistillConfig], float] = distill_step,
    ) -> None:
        """``records``: the training examples (distillation records by default); ``step_fn``:
        one optimizer step on a batch of them, returning the loss (default :func:`distill_step`)."""
        if not records:
            raise ValueError("no training records")
        self.draft, self.records, self.config = draft, records, config
        self.step_fn = step_fn
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation), drawn once per epoch
        self.out_dir = Path(out_dir)
        self.metadata = metadata or {}
        self.draft.requires_grad_(True)
        params = [p for p in draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.step = 0
        self.losses: list[float] = []
        old, final = self.out_dir / ".checkpoint-old", self.out_dir / "checkpoint"
        if old.exists() and not final.exists():  # a crash between the two renames of save()
            os.replace(old, final)
        if (final / "meta.json").exists():
            self._resume()

    def run(self, progress: bool = True, until: int | None = None) -> list[float]:
        """Train up to ``config.steps`` (or stop, checkpointed, at step ``until``); returns the
        loss of every step run so far."""
        last = min(self.config.steps, until if until is not None else self.config.steps)
        columns = [TextColumn("distill"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("", total=self.config.steps, completed=self.step, info="")

            def after_step(step: int, loss: float) -> None:
                self.losses.append(loss)
                self.step = step + 1
                bar.update(task, completed=self.step, info=f"loss {loss:.4f}")
                if self.step % self.config.checkpoint_every == 0 or self.step == last:
                    self.save()

            batches = (self._batch(step) for step in range(self.step, last))
            run_steps(self.draft, self.optimizer, lambda model, optimizer, batch: self.step_fn(model, optimizer, batch, self.config.distill),
                      batches, lr_at=self.config.lr_at, after_step=after_step, first=self.step)
        return self.losses

    def _batch(self, step: int) -> list[DistillRecord]:
        per_epoch = max(1, len(self.records) // self.config.batch_size)
        epoch, index = divmod(step, per_epoch)
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.records)))
            random.Random(f"{self.config.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        order = self._order[1]
        chosen = order[index * self.config.batch_size: (index + 1) * self.config.batch_size]
        return [self.records[i] for i in chosen]

    def save(self) -> Path:
        """Write weights, optimizer state and metadata to ``out_dir/checkpoint`` atomically."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=self.out_dir))
        save_file(unique_tensors(self.draft.state_dict()), str(tmp / "draft.safetensors"))
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        meta = {
            **self.metadata,
            "step": self.step,
            "loss": self.losses[-1] if self.losses else None,
            "losses": self.losses,
            "config": asdict(self.config),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        final = self.out_dir / "checkpoint"
        old = self.out_dir / ".checkpoint-old"
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        return final

    def _resume(self) -> None:
        path = self.out_dir / "checkpoint"
        meta = json.loads((path / "meta.json").read_text())
        load_weights(self.draft, load_file(str(path / "draft.safetensors")), f"the checkpoint in {path}")
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        self.step, self.losses = meta["step"], meta["losses"]
