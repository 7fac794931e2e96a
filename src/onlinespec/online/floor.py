"""A floor on served acceptance: a learned draft never keeps serving below the draft it started from.

Online distillation (arXiv 2310.07177, section 4.2) can lose acceptance where the traffic shifts: a
draft tuned to the last domain serves the next one worse than the static draft it was born from
(docs/online-learning.md). The gate cannot see that: it compares a candidate with the draft that
serves now, so a line of versions that each lost a little, within the gate's noise, passes.

At every update of a draft that is replayed (a feature head), :class:`AcceptanceFloor` scores the
starting draft (the registry's first version, which pruning keeps) on the same held-out records
the gate scored the serving draft on: what the hybrid proposer serving with each would have
accepted there, replayed from the recorded target features, paired record by record. Where the
serving draft accepts less with one-sided 95% confidence (its ratio plus ``Z`` paired standard
errors below the starting draft's), the floor is breached: the candidate of this update is
published only if it is no worse than the starting draft (the gate's margin), and otherwise the
starting draft serves again. The next candidates train from it, and the gate publishes the first
that serves no worse than it: the static draft serves until a candidate beats it.
"""

from __future__ import annotations

from collections.abc import Callable

from onlinespec.online.gate import paired_error
from onlinespec.online.learnable import LearnableDraft
from onlinespec.online.publisher import Publisher

Z = 1.645  # one-sided 95%: the standard errors by which the serving draft must fall below the starting one
MIN_RECORDS = 4  # held-out records under which the paired error means nothing: no floor decision


class AcceptanceFloor:
    def __init__(self, learnable: LearnableDraft, publisher: Publisher, measure: Callable) -> None:
        """``measure(model, records)``: the gate's replayed figures of ``model`` on ``records``."""
        self.learnable, self.publisher, self.measure = learnable, publisher, measure
        self.static: str | None = None  # the starting draft's version, as the last judgement found it

    def static_version(self) -> str | None:
        """The starting draft: the registry's first version, if it is a root (its parent None)."""
        registry = self.publisher.registry
        versions = registry.versions()
        if not versions or registry.meta(versions[0]).get("parent") is not None:
            return None  # a registry pruned before the first version was kept: no floor
        return versions[0]

    def judge(self, serving_version: str, held_out: list, before: dict, figure: str, margin: float) -> dict | None:
        """The floor's figures on ``held_out`` (the gate's records, where the serving draft scored
        ``before``), or None where it does not apply: a draft that cannot be replayed, a gate
        that decided by alpha (a cold draft), under ``MIN_RECORDS`` held out, or the starting
        draft serving itself."""
        if figure != "replayed" or not self.learnable.replays or len(held_out) < MIN_RECORDS or "requests" not in before:
            return None
        version = self.static_version()
        if version is None or version == serving_version:
            return None
        # loaded for this judgement and let go after it: kept, it would hold a body (and, before heads
        # shared their output rows, the rows too) per learning draft for the whole run (issue 46's memory soak)
        self.static = version
        static = self.measure(self.publisher.load(version), held_out)
        error = paired_error(static, before)
        below = before[figure] + Z * error < static[figure]
        return {"static_version": version, "static": static[figure], "serving": before[figure],
                "error": error, "below": below, "floor": static[figure] - margin}

    def serve_static(self) -> str:
        """Serve the starting draft again, from the next step on; its version."""
        version = self.static
        self.publisher.serve(self.publisher.load(version), version)  # a copy of its own: candidates train from it
        return version
