"""The next-requests gate (``LearnerConfig.gate = "next"``): judge a candidate on the requests
served after it was trained.

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

from dataclasses import dataclass


@dataclass
class Pending:
    candidate: object
    optimizer: object
    examples: int
    steps: int
    parent: str
    trained_on: set  # id() of the records it trained on (the pending entry keeps them alive)
    records: list


class NextGate:
    def __init__(self) -> None:
        self.pending: Pending | None = None

    def take(self, records: list, parent: str, gate_by: str):
        """(candidate, optimizer, examples, steps, held-out groups) of the pending candidate, judged on
        ``records`` it did not train on; None if there is none to judge (yet)."""
        pending = self.pending
        if pending is None or pending.parent != parent:
            self.pending = None
            return None
        fresh = [r for r in records if id(r) not in pending.trained_on]
        if not fresh:
            return None
        self.pending = None
        return pending.candidate, pending.optimizer, pending.examples, pending.steps, groups(fresh, gate_by)

    def train(self, learner, records: list) -> None:
        """Train the next candidate on every record, from the newest published draft; keep it pending."""
        serving, parent = learner._latest
        trained = learner._train(serving, records)
        if trained is not None:
            candidate, optimizer, examples, steps = trained
            self.pending = Pending(candidate, optimizer, examples, steps, parent, {id(r) for r in records}, list(records))


def groups(records: list, gate_by: str) -> dict[str, list]:
    """The records a candidate is judged on, pooled (``newest``) or by domain."""
    if gate_by == "newest":
        return {"all": records}
    by_domain: dict[str, list] = {}
    for record in records:
        by_domain.setdefault(record.domain, []).append(record)
    return by_domain
