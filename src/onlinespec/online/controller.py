"""Learn when it pays: each draft's updates back off when they stop earning, and come back on drift.

What an update earns is what serving sees: the tokens per target forward (tau, arXiv 2310.07177
section 3's expected tokens per round) of the requests the new version served, against those its
parent served just before it, pooled over ``window`` requests each. A version that raised tau by at
least ``min_gain`` earned its update; after ``patience`` updates in a row that did not (a refused
candidate earns nothing either), the draft's update interval doubles, and doubles again after each
further one that earns nothing, up to ``max_backoff`` times the configured interval. One that earns
sets it back to the configured interval, as does a detected drift (the content router's alpha
detector, :meth:`OnlineLearner.hurry`). New and cold drafts therefore update at the full rate, and
a domain that has learnt what it can costs the engine a few updates an hour.

A cold draft (born from the target, :meth:`LearnableDraft.cold`) is judged by what it learnt
instead: a published version whose held-out alpha (the gate's figure) rose by at least
``min_alpha_gain`` earned its update. Its tau is no measure of that: until it has learnt enough
for adaptive k to draft with it, a better cold head moves tau by less than ``min_gain`` (on
llama.cpp here, +0.002-0.003 for versions that gained 0.08-0.15 alpha: the controller backed the
cold start's fresh head off x8 within 350 requests, docs/online-learning.md).

The engine's learning share follows: the operator's ``--learn-share`` while any draft updates at
the full rate, less (divided by the smallest backoff) once all have backed off. So does recording:
a draft backed off ``b`` times traces and stores one request in ``b``
(:meth:`OnlineLearner.records_next`), so its updates still see about I requests' records. Every decision is
an event (``learn_control``) in the event log and the report.

What no update can earn is not tried at all: under a load where no draft could pay (a batch so
large that a wider forward costs what its extra tokens bring), the engine gives no turn and
records nothing, whatever this controller allows (the headroom,
:meth:`onlinespec.online.turns.EngineTurns.headroom`); learning there waits for idle time.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class ControllerConfig:
    window: int = 16  # requests served by a version (and by its parent before it) that judge an update
    min_gain: float = 0.01  # tokens per target forward an update must add to have earned its cost
    min_alpha_gain: float = 0.01  # held-out alpha a cold draft's published update must add
    patience: int = 2  # updates in a row that earn nothing before a draft backs off (3 cost 0.86x in docs/online-learning.md)
    max_backoff: int = 16  # the longest a draft's update interval grows, in configured intervals


@dataclass
class _DraftLedger:
    served: deque = field(default_factory=lambda: deque(maxlen=64))  # (version, new tokens, target forwards)
    pending: list = field(default_factory=list)  # [version, parent tau, engine seconds]: published, not yet judged
    idle: int = 0  # updates in a row that earned nothing
    backoff: int = 1


class LearnController:
    """Fed with every served request (:meth:`served`) and every finished update (:meth:`updated`);
    its decisions are returned as events and read through :meth:`backoff` and :meth:`share`."""

    def __init__(self, limit: float, config: ControllerConfig | None = None) -> None:
        self.limit, self.config = limit, config or ControllerConfig()
        self.drafts: dict[str, _DraftLedger] = {}
        self.lock = threading.Lock()  # served (the recorder), updated and drift (learner threads)

    def served(self, draft: str, version: str | None, new_tokens: int, forwards: int) -> list[dict]:
        """A request ``draft`` served with ``version``; the decisions it completes."""
        with self.lock:
            ledger = self.drafts.setdefault(draft, _DraftLedger())
            ledger.served.append((version, new_tokens, forwards))
            events = []
            for pending in list(ledger.pending):
                version_now, parent_tau, seconds = pending
                tau = self._tau(ledger, version_now)
                if tau is not None:
                    ledger.pending.remove(pending)
                    events.append(self._judge(draft, ledger, version_now, tau - parent_tau, seconds))
            return events

    def updated(self, draft: str, version: str | None, parent: str | None, engine_seconds: float,
                alpha_gain: float | None = None) -> list[dict]:
        """An update of ``draft`` ended: ``version`` published (None: refused by the gate, or
        superseded); the decision at once for a refused one, later for a published one.
        ``alpha_gain``: a cold draft's gain in held-out alpha, by which it is judged at once."""
        with self.lock:
            ledger = self.drafts.setdefault(draft, _DraftLedger())
            if version is None:
                return [self._judge(draft, ledger, None, 0.0, engine_seconds)]
            if alpha_gain is not None:
                return [self._judge(draft, ledger, version, alpha_gain, engine_seconds, self.config.min_alpha_gain, "alpha")]
            parent_tau = self._tau(ledger, parent)
            if parent_tau is None:  # the parent served too little to compare (a first update): it earned its keep
                return [self._judge(draft, ledger, version, None, engine_seconds)]
            ledger.pending.append([version, parent_tau, engine_seconds])
            return []

    def drift(self, draft: str) -> list[dict]:
        """A drift was detected for ``draft``: learn at the full rate again."""
        with self.lock:
            ledger = self.drafts.setdefault(draft, _DraftLedger())
            if ledger.backoff == 1 and not ledger.idle:
                return []
            ledger.idle, ledger.backoff = 0, 1
            return [{"event": "learn_control", "draft": draft, "decision": "drift: full rate", "backoff": 1, "share": self.share()}]

    def backoff(self, draft: str) -> int:
        ledger = self.drafts.get(draft)
        return ledger.backoff if ledger else 1

    def share(self) -> float:
        """The engine's learning share now: the limit while any draft learns at the full rate."""
        least = min((ledger.backoff for ledger in self.drafts.values()), default=1)
        return self.limit / least

    # ---- internals -------------------------------------------------------------------------------

    def _tau(self, ledger: _DraftLedger, version: str | None) -> float | None:
        """Tokens per target forward over the newest ``window`` requests ``version`` served, if it served that many."""
        rows = [(n, f) for v, n, f in ledger.served if v == version][-self.config.window:]
        if len(rows) < self.config.window:
            return None
        return sum(n for n, _ in rows) / max(1, sum(f for _, f in rows))

    def _judge(self, draft: str, ledger: _DraftLedger, version: str | None, gain: float | None, seconds: float,
               min_gain: float | None = None, measure: str = "tau") -> dict:
        """``gain``: in ``measure`` (tau, or a cold draft's held-out alpha), against ``min_gain``."""
        c = self.config
        earned = gain is None or gain >= (c.min_gain if min_gain is None else min_gain)
        ledger.idle = 0 if earned else ledger.idle + 1
        before = ledger.backoff
        ledger.backoff = 1 if earned else (min(c.max_backoff, 2 * before) if ledger.idle >= c.patience else before)
        decision = ("full rate" if ledger.backoff == 1 else "backing off") if ledger.backoff != before or earned else "waiting"
        return {"event": "learn_control", "draft": draft, "version": version, "gain": None if gain is None else round(gain, 4), "measure": measure,
                "engine_seconds": round(seconds, 3), "earned": earned, "idle_updates": ledger.idle, "backoff": ledger.backoff,
                "decision": decision, "share": round(self.share(), 4)}
