"""The online learner's settings (:class:`LearnerConfig`; arXiv 2310.07177, section 4.2: every I requests,
distil the serving draft on the replay buffer). :mod:`onlinespec.online.learner` re-exports them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from onlinespec.decoding.feature_head import CHAIN_DEPTH
from onlinespec.distill.step import DistillConfig
from onlinespec.online.recorder import POSITION_POLICIES, SAMPLING_MODES

UNITS = ("requests", "records", "tokens")
PRIORITIES = ("low", "idle", "normal")


@dataclass
class LearnerConfig:
    update_interval: int = 25  # I
    interval_unit: str = "requests"  # requests | records | tokens (generated tokens)
    position_policy: str = "verified"  # which verified positions become training rows (recorder; the paper: rejected)
    distill: DistillConfig = field(default_factory=DistillConfig)
    steps_per_update: int = 40
    batch_size: int = 32  # examples per step: chain starts for a feature head, records for a draft LM
    lr: float = 5e-5  # measured best of 3e-4, 1e-4, 5e-5 on a familiar and an unseen domain (docs/faster-drafts.md)
    cold_lr: float = 1e-3  # a draft that starts from nothing (a fresh head): the offline warm-up's rate (docs/drafts.md)
    cold_steps: int = 4  # and this many times steps_per_update: +0.02-0.05 step-1 alpha by request 300 (bench/fresh_head_data.py)
    shift_updates: int = 3  # a draft's first updates on traffic it has not learnt from (a new draft, a drift) take
    shift_scale: float = 2.0  # this many times lr and steps_per_update (onlinespec.online.schedule)
    gate_fraction: float = 0.2  # the newest share of the buffer's records, held out to judge a candidate
    gate_margin: float = 0.0  # publish if candidate alpha >= serving alpha - margin
    gate: str = "holdout"  # holdout: judge on the newest gate_fraction held out of training; next: train on
    # every record, judge on the records served after it (onlinespec.online.gate)
    gate_metric: str = "auto"  # replayed: what the hybrid proposer serving with each draft accepts over the
    # judged records, replayed (a feature head; agreed with the truth on 14-15 of 20 candidates where alpha
    # agreed on 10, docs/faster-drafts.md section 3); alpha: teacher-forced step-1 alpha (a draft LM always);
    # auto: replayed, but alpha while a head is cold (born from the target: nearly every candidate gains, and on
    # the cold start the alpha gate's cheaper updates served 0.48 against 0.36 by request 300, docs/online-learning.md)
    gate_by: str = "domain"  # domain: hold out the newest share of EACH domain's records, and publish only
    # if the candidate loses on none of them (a draft tuned to the newest traffic must not serve the rest
    # worse); newest: the newest share of all records, judged pooled
    floor: bool = True  # serve the starting draft while the learned one accepts less than it on the gate's held-out
    # records, paired, with one-sided 95% confidence, until a candidate beats it (onlinespec.online.floor)
    sampling: str = "teacher"  # sampling mode of the training signal: teacher | student | mixed (recorder)
    threads: int = 1  # torch threads of the learner thread (serving keeps the rest)
    priority: str = "low"  # low: nice 19 (the OS runs the learner mostly on CPU time serving leaves); idle:
    # SCHED_IDLE (a serving thread that wakes takes the core at once); normal (see lower_priority)
    cpu_share: float = 1.0  # the most wall time the learner computes (it sleeps the rest)
    chain_depth: int = CHAIN_DEPTH  # feature heads: draft steps unrolled in training
    max_failures: int = 3  # updates failing in a row before the learner stops trying (serving goes on)
    keep_versions: int = 0  # keep this many newest registry versions (plus the current one, its parent and the first); 0: all

    def __post_init__(self) -> None:
        if self.position_policy not in POSITION_POLICIES:
            raise ValueError(f"unknown position policy {self.position_policy!r}: use one of {POSITION_POLICIES}")
        if not (math.isfinite(self.lr) and self.lr > 0 and math.isfinite(self.cold_lr) and self.cold_lr > 0):
            raise ValueError(f"the learning rate must be a positive number, got lr {self.lr}, cold_lr {self.cold_lr}")
        if not 0.0 < self.gate_fraction < 1.0:
            raise ValueError(f"gate_fraction must lie in (0, 1), got {self.gate_fraction}")
        if not (math.isfinite(self.gate_margin) and self.gate_margin >= 0):
            raise ValueError(f"gate_margin must be >= 0, got {self.gate_margin}")
        if self.batch_size < 1 or self.chain_depth < 1 or self.max_failures < 1 or self.keep_versions < 0:
            raise ValueError("batch_size, chain_depth and max_failures must be >= 1, keep_versions >= 0")
        if self.interval_unit not in UNITS:
            raise ValueError(f"unknown interval unit {self.interval_unit!r}: use one of {UNITS}")
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(f"unknown sampling mode {self.sampling!r}: use one of {SAMPLING_MODES}")
        if self.gate not in ("holdout", "next"):
            raise ValueError(f"gate must be 'holdout' or 'next', got {self.gate!r}")
        if self.gate_metric not in ("auto", "replayed", "alpha"):
            raise ValueError(f"gate_metric must be 'auto', 'replayed' or 'alpha', got {self.gate_metric!r}")
        if self.gate_by not in ("domain", "newest"):
            raise ValueError(f"gate_by must be 'domain' or 'newest', got {self.gate_by!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {PRIORITIES}, got {self.priority!r}")
        if not 0.0 < self.cpu_share <= 1.0:
            raise ValueError(f"cpu_share must lie in (0, 1], got {self.cpu_share}")
        if self.shift_updates < 0 or not (math.isfinite(self.shift_scale) and self.shift_scale > 0):
            raise ValueError(f"shift_updates must be >= 0 and shift_scale > 0, got {self.shift_updates}, {self.shift_scale}")
        if self.update_interval < 1 or self.steps_per_update < 1 or self.cold_steps < 1 or self.threads < 1:
            raise ValueError("update_interval, steps_per_update, cold_steps and threads must be >= 1")
