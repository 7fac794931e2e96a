"""Train a candidate: a private copy of the serving draft, distilled on the replay buffer's records
(arXiv 2310.07177, section 4.2). The serving draft is never touched; Adam's moments carry on from
the candidate last published, so that a fresh optimizer's first steps do not jump by ~lr everywhere."""

from __future__ import annotations

import copy
import threading
import time

import torch

from onlinespec.distill.loop import run_steps
from onlinespec.online.budget import UpdateBudget
from onlinespec.online.config import LearnerConfig
from onlinespec.online.learnable import LearnableDraft
from onlinespec.online.schedule import UpdatePlan, UpdateSchedule


class CandidateTrainer:
    def __init__(self, config: LearnerConfig, learnable: LearnableDraft, budget: UpdateBudget, cancel: threading.Event) -> None:
        self.config, self.learnable, self.budget, self.cancel = config, learnable, budget, cancel
        self.steps_done = 0  # optimizer steps taken by all updates (cancelled ones included)
        self.optimizer_state: dict | None = None  # the optimizer of the newest published draft
        self.schedule = UpdateSchedule.of(config)  # each update's rate and steps, by the draft's phase

    def train(self, serving, records: list, seed: int):
        """Train a private copy of ``serving`` on ``records``: (candidate, optimizer, examples
        drawn from, the :class:`UpdatePlan` it followed), or None if there is nothing to train on
        or the update was cancelled. ``seed`` draws the batches."""
        config = self.config
        objective = self.learnable.objective(records, config.position_policy, config.chain_depth, config.distill)
        if not objective.examples:
            return None
        candidate = self.learnable.copy(serving)  # the serving draft is never touched
        self.learnable.adapt(candidate, records)
        plan: UpdatePlan = self.schedule.plan(self.learnable.cold(serving))
        optimizer = torch.optim.AdamW([p for p in candidate.parameters() if p.is_floating_point()], lr=plan.lr)
        if self.optimizer_state is not None:  # carry Adam's moments on: a fresh optimizer's first steps jump by ~lr everywhere
            optimizer.load_state_dict(self.optimizer_state)
            for group in optimizer.param_groups:
                group["lr"] = plan.lr
        generator = torch.Generator().manual_seed(seed)
        n, size = len(objective.examples), min(config.batch_size, len(objective.examples))
        batches = ([objective.examples[i] for i in torch.randint(n, (size,), generator=generator).tolist()] for _ in range(plan.steps))
        tick = [time.perf_counter()]

        def after_step(i: int, loss: float) -> None:
            self.steps_done += 1
            tick[0] = self.budget.step_done(tick[0])

        run_steps(candidate, optimizer, objective.step, batches, stop=self.cancel.is_set, after_step=after_step)
        optimizer.zero_grad(set_to_none=True)  # the candidate serves next: its gradients would stay with it, a body's size per draft
        if self.cancel.is_set():
            return None
        self.schedule.done()
        return candidate, optimizer, n, plan

    def carry(self, optimizer) -> None:
        """The candidate trained with ``optimizer`` was published: the next update carries its moments on."""
        self.optimizer_state = copy.deepcopy(optimizer.state_dict())

    def forget(self) -> None:
        """Another version serves now (a rollback): the next update starts a fresh optimizer."""
        self.optimizer_state = None
