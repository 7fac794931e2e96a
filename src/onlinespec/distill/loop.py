"""The one training loop every distillation runs (the warm-up trainer, the online learner, the
bulk GPU job, the offline simulation): for each batch, set the learning rate, take one optimizer
step, hand the loss to the caller. What differs between them (how batches are drawn, when to stop,
checkpoints, progress, a CPU budget) is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

Step = Callable[[torch.nn.Module, torch.optim.Optimizer, list], float]


def run_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: Step,
    batches: Iterable,
    lr_at: Callable[[int], float] | None = None,
    stop: Callable[[], bool] | None = None,
    after_step: Callable[[int, float], None] | None = None,
    first: int = 0,
) -> list[float]:
    """Train ``model`` on each batch of ``batches`` with ``step`` (one optimizer step, returning its
    loss); steps are numbered from ``first``. ``lr_at(i)`` sets step i's learning rate;
    ``stop()`` ends the loop before a step; ``after_step(i, loss)`` runs after each. Returns the
    losses of the steps taken; ``model`` is left in eval mode with gradients off."""
    losses: list[float] = []
    model.requires_grad_(True)
    try:
        for i, batch in enumerate(batches, start=first):
            if stop is not None and stop():
                break
            if lr_at is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(i)
            losses.append(step(model, optimizer, batch))
            if after_step is not None:
                after_step(i, losses[-1])
    finally:
        model.requires_grad_(False).eval()
    return losses
