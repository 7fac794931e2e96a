"""How large each update of a draft is: its learning rate and optimizer steps, by the draft's phase.

One update at the steady rate moves a converged head's acceptance by about its own noise (0.003
at lr 5e-5 against a standard error of 0.002-0.005, docs/faster-drafts.md), which is right for a
draft that serves its traffic well: small steps lose less of what it learnt. A draft that has just
met traffic it has not seen needs the opposite, and that is when learning can pay most. So:

* **cold**: a draft born from the target (:meth:`LearnableDraft.cold`) learns at the offline
  warm-up's rate, ``cold_lr``, for ``cold_steps`` times the steps;
* **shifted**: the first ``shift_updates`` updates after a draft starts serving traffic it has not
  learnt from (a new draft, a server's first updates on a draft no update has published, or a
  drift the content router detected, :meth:`OnlineLearner.hurry`) take ``shift_scale`` times the learning rate and the steps;
* **steady**: after that, ``lr`` and ``steps_per_update``; the learning controller
  (:mod:`onlinespec.online.controller`) spaces the updates out once they stop earning.

How the defaults were chosen: docs/online-learning.md, "Update size".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UpdatePlan:
    lr: float
    steps: int
    phase: str  # cold, shifted or steady


class UpdateSchedule:
    """The plan of a draft's next update; :meth:`shifted` when its traffic changes, :meth:`done`
    after each update (whatever the gate decided). :class:`~onlinespec.online.config.LearnerConfig`
    checks the settings."""

    def __init__(self, lr: float, steps: int, cold_lr: float, cold_steps: int, shift_updates: int, shift_scale: float) -> None:
        self.lr, self.steps, self.cold_lr, self.cold_steps = lr, steps, cold_lr, cold_steps
        self.shift_updates, self.shift_scale = shift_updates, shift_scale
        self.since_shift = 0  # updates since the draft met new traffic (a new draft starts there)

    @classmethod
    def of(cls, config) -> UpdateSchedule:
        """The schedule a :class:`~onlinespec.online.config.LearnerConfig` describes."""
        return cls(config.lr, config.steps_per_update, config.cold_lr, config.cold_steps, config.shift_updates, config.shift_scale)

    def plan(self, cold: bool) -> UpdatePlan:
        if cold:
            return UpdatePlan(self.cold_lr, self.steps * self.cold_steps, "cold")
        if self.since_shift < self.shift_updates:
            return UpdatePlan(self.lr * self.shift_scale, max(1, round(self.steps * self.shift_scale)), "shifted")
        return UpdatePlan(self.lr, self.steps, "steady")

    def shifted(self) -> None:
        """The draft's traffic changed (a detected drift): the next updates are the shifted ones."""
        self.since_shift = 0

    def resume(self) -> None:
        """The draft learnt online before (a restarted server whose registry holds its versions):
        its updates are steady ones until a drift."""
        self.since_shift = max(self.since_shift, self.shift_updates)

    def done(self) -> None:
        self.since_shift += 1
