"""The gate (arXiv 2310.07177, section 4.2, made safe): a candidate the learner trained is published
only if it serves no worse than the draft serving now (:class:`CandidateGate`).

The next-requests gate (``LearnerConfig.gate = "next"``, :class:`NextGate`): judge a candidate on
the requests served after it was trained.

The hold-out gate (``"holdout"``) judges a candidate on the newest share of the records it was
not trained on: 20% of 10-100 requests, too few positions to tell a 0.01 change
(docs/faster-drafts.md, section 3). This gate trains each candidate on every record instead and
keeps it pending; at the next update, the records served since (their verifications are
recorded: judging them costs no target time) score the candidate against the serving draft,
and the learner publishes it if it is no worse (``gate_margin``, per domain with ``gate_by``).
The next candidate then trains from whatever serves. A candidate whose parent no longer serves
(a rollback, another process's version) is dropped, never judged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onlinespec.online.config import LearnerConfig
from onlinespec.online.learnable import LearnableDraft

DOMAIN_NOISE = 2.0  # standard errors a held-out domain's alpha may fall by in the gate (LearnerConfig.gate_by="domain")


@dataclass
class Pending:
    candidate: object
    optimizer: object
    examples: int
    plan: object  # the UpdatePlan it was trained by (onlinespec.online.schedule)
    parent: str
    trained_on: set  # id() of the records it trained on (the pending entry keeps them alive)
    records: list


class NextGate:
    def __init__(self) -> None:
        self.pending: Pending | None = None

    def take(self, records: list, parent: str, gate_by: str):
        """(candidate, optimizer, examples, plan, held-out groups) of the pending candidate, judged on
        ``records`` it did not train on; None if there is none to judge (yet)."""
        pending = self.pending
        if pending is None or pending.parent != parent:
            self.pending = None
            return None
        fresh = [r for r in records if id(r) not in pending.trained_on]
        if not fresh:
            return None
        self.pending = None
        return pending.candidate, pending.optimizer, pending.examples, pending.plan, groups(fresh, gate_by)

    def train(self, train: Callable, latest: tuple, records: list) -> None:
        """Train the next candidate on every record (``train(serving, records)``), from ``latest``,
        the newest published draft and its version; keep it pending."""
        serving, parent = latest
        trained = train(serving, records)
        if trained is not None:
            candidate, optimizer, examples, plan = trained
            self.pending = Pending(candidate, optimizer, examples, plan, parent, {id(r) for r in records}, list(records))


def groups(records: list, gate_by: str) -> dict[str, list]:
    """The records a candidate is judged on, pooled (``newest``) or by domain."""
    if gate_by == "newest":
        return {"all": records}
    by_domain: dict[str, list] = {}
    for record in records:
        by_domain.setdefault(record.domain, []).append(record)
    return by_domain


def paired_error(before: dict, after: dict) -> float:
    """The standard error of the difference in the gate's figure between two drafts scored on the
    same records: of the mean per-position difference in alpha (``alphas``), or, for the replayed
    figure (``requests``: each record's [accepted, judged]), of the difference of two ratios
    sum(accepted) / sum(judged), by the delta method over records. 0 without those figures, or
    under two positions or records."""
    if "requests" in before and "requests" in after:
        b, a = before["requests"].double(), after["requests"].double()
        if len(b) < 2:
            return 0.0
        def influence(x):  # each record's share of the ratio's error
            total = x[:, 1].sum().clamp_min(1)
            return (x[:, 0] - x[:, 0].sum() / total * x[:, 1]) / total
        diff = influence(a) - influence(b)
        return float((diff.pow(2).sum() * len(diff) / (len(diff) - 1)).sqrt())
    if "alphas" not in before or "alphas" not in after or len(before["alphas"]) < 2:
        return 0.0
    diff = (after["alphas"] - before["alphas"]).double()
    return float(diff.std() / len(diff) ** 0.5)


class CandidateGate:
    """Which records judge a candidate, by which figure, and whether it passes."""

    def __init__(self, config: LearnerConfig, learnable: LearnableDraft, pause: Callable[[], None]) -> None:
        """``pause()`` runs between two units of the evaluation (the engine's turn, :mod:`onlinespec.online.budget`)."""
        self.config, self.learnable, self.pause = config, learnable, pause

    def held_out(self, records: list) -> tuple[list, dict[str, list]]:
        """(training records, held-out groups): the newest ``gate_fraction`` of each domain's
        records (``gate_by="domain"``; a domain with a single record is only judged), or of all
        records in one group (``"newest"``)."""
        fraction = self.config.gate_fraction
        if self.config.gate_by == "newest":
            n = max(1, int(len(records) * fraction))
            return records[:-n], {"all": records[-n:]}
        by_domain: dict[str, list] = {}
        for record in records:
            by_domain.setdefault(record.domain, []).append(record)
        groups = {d: rs[-max(1, int(len(rs) * fraction)):] for d, rs in by_domain.items()}
        held = {id(r) for rs in groups.values() for r in rs}
        return [r for r in records if id(r) not in held], groups

    def figure(self, cold: bool) -> str:
        """The figure the gate decides by (``LearnerConfig.gate_metric``): 'auto' is the replayed
        acceptance, or alpha while the draft is ``cold``; a draft LM, which cannot be replayed
        without the target, is always judged by alpha."""
        metric = self.config.gate_metric
        if metric == "auto":
            metric = "alpha" if cold else "replayed"
        return metric if self.learnable.replays else "alpha"

    def measure(self, model, records: list, replay: bool, per_position: bool = False) -> dict:
        """``model``'s figures on ``records`` (:meth:`LearnableDraft.metrics`), computed in the
        engine's turns: a chunk of positions is a unit of work."""
        self.pause()
        return self.learnable.metrics(model, records, self.config.distill, between=self.pause, per_position=per_position, replay=replay)

    def judge(self, serving, candidate, groups: dict[str, list], figure: str):
        """(serving's figures, the candidate's, {domain: [figure before, after]}, passed): the
        candidate passes if its ``figure`` (:meth:`figure`: the replayed acceptance, or alpha) on the
        held-out records is no worse than the serving draft's (less ``gate_margin``), pooled and,
        with several domains, on each, where a domain may fall by its noise: ``DOMAIN_NOISE``
        standard errors of the two drafts' paired difference (a draft LM, which has no
        per-position figures: none). A domain holds out a few requests' positions; a candidate
        that gained 0.12 pooled was refused for -0.003 on one of three (docs/online-learning.md).
        A feature head's pooled figures come from its domains' (``LearnableDraft.pool``): each
        held-out record is measured, and replayed, once per draft."""
        margin = self.config.gate_margin
        held_out = [r for rs in groups.values() for r in rs]
        replay = figure == "replayed"

        def measured(model, records, per_position=False):
            return self.measure(model, records, replay, per_position)

        parts = {domain: (measured(serving, records, not replay), measured(candidate, records, not replay))
                 for domain, records in (groups.items() if len(groups) > 1 else ())}
        if parts and self.learnable.pool:  # the pool from each domain's figures: each record measured once
            before, after = (self.learnable.pool([pair[i] for pair in parts.values()]) for i in (0, 1))
        else:
            before, after = measured(serving, held_out), measured(candidate, held_out)
        passed, by_domain = after[figure] >= before[figure] - margin, {}
        for domain, (b, a) in parts.items():
            by_domain[domain] = [b[figure], a[figure]]
            passed = passed and a[figure] >= b[figure] - margin - DOMAIN_NOISE * paired_error(b, a)
        return before, after, by_domain, passed
