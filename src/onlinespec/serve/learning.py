"""Learning in the engine's turns (``--learn-share``, :mod:`onlinespec.online.turns`): updates
compute on the engine thread between two steps, so they never slow a step down. The engine loop
gives the learners a turn whenever they want one while it is idle, and under load while the share
of its time spent learning is below the limit times the headroom (the share of its serving time at
batch sizes where a draft could pay at all, :func:`onlinespec.decoding.adaptive.could_pay`); so
does recording (:meth:`OnlineLearner.records_next`). The learning controller
(:mod:`onlinespec.online.controller`) sets that limit and each draft's update interval from what
the drafts served and what their updates bought."""

from __future__ import annotations

import functools
from collections.abc import Callable

from onlinespec.decoding.adaptive import AdaptiveK, could_pay
from onlinespec.decoding.request import RequestStats
from onlinespec.online.controller import LearnController
from onlinespec.online.pool import ServedDraft
from onlinespec.online.turns import EngineTurns
from onlinespec.serve.metrics import ServeMetrics


class LearningShare:
    """``drafts()`` gives the pool's drafts (whose update intervals the controller sets);
    ``event`` writes each of the controller's decisions to the event log; ``on_wanted`` wakes
    the engine loop when a learner wants a turn."""

    def __init__(self, limit: float, metrics: ServeMetrics, drafts: Callable[[], dict[str, ServedDraft]],
                 event: Callable[[dict], None], on_wanted: Callable[[], None], planner: AdaptiveK | None = None, k: int = 0) -> None:
        """``planner``: the drafts' cost curve, by which a step's batch size is judged payable
        (:func:`could_pay` with ``k`` proposals); None: every step is."""
        self.turns = EngineTurns(limit, on_wanted=on_wanted)
        self.payable = functools.lru_cache(maxsize=None)(lambda batch: planner is None or could_pay(planner, batch, k))
        self.controller = LearnController(limit)  # learn when it pays
        self.metrics, self.drafts, self.event = metrics, drafts, event
        metrics.learn_share_limit.set(limit)

    def wanted(self) -> bool:
        return self.turns.wanted()

    def give(self, idle: bool) -> None:
        """Give the learner a turn: when idle, whenever it wants one; under load, while the share
        of the engine's time spent learning is below the limit."""
        turns = self.turns
        if turns.due() if not idle else turns.wanted():
            self.metrics.learn_seconds.inc(turns.give())
        self.metrics.learn_share.set(turns.spent())

    def stepped(self, seconds: float, batch: int) -> None:
        """The engine served a step of ``batch`` requests that took ``seconds`` (0: prompt chunks
        only, which no draft speeds up or slows down); a learner's turn may be due."""
        self.turns.served(seconds, batch < 1 or self.payable(batch))
        self.metrics.learn_headroom.set(self.turns.headroom())
        self.give(idle=False)

    def served(self, draft: ServedDraft, stats: RequestStats) -> None:
        self._control(self.controller.served(draft.name, draft.version, stats.new_tokens, stats.target_calls))

    def learner_event(self, event: dict) -> None:
        """An update ended (the controller judges what it bought) or a drift hurried one."""
        name = event.get("draft", "")
        if event["event"] == "update":
            cold = event.get("cold") and event["version"]  # judged by what it learnt (LearnController.updated)
            self._control(self.controller.updated(name, event["version"], event["parent"], event["engine_seconds"],
                                                  event["alpha_after"] - event["alpha_before"] if cold else None))
        elif event["event"] == "hurried":
            self._control(self.controller.drift(name))

    def _control(self, decisions: list[dict]) -> None:
        """Carry out the controller's decisions: each draft's update interval, the engine's share."""
        for decision in decisions:
            draft = self.drafts().get(decision["draft"])
            if draft is not None and draft.learner is not None:
                draft.learner.backoff = decision["backoff"]
            self.turns.share = self.controller.share()
            self.metrics.learn_share_limit.set(self.turns.share)
            self.event(decision)

    def state(self) -> dict:
        """The share allowed now (the controller's, at most --learn-share), the share spent over the
        last 30 s, the engine seconds and turns given, each draft's update interval backoff."""
        turns = self.turns
        return dict(share_limit=round(turns.share, 4), share_spent=round(turns.spent(), 4), headroom=round(turns.headroom(), 4),
                    engine_seconds=round(turns.learn_seconds_total, 3), turns=turns.turns_total,
                    longest_turn_seconds=round(turns.longest_turn_seconds, 3),
                    backoff={name: d.learner.backoff for name, d in self.drafts().items() if d.learner is not None})

    def close(self) -> None:
        """No engine gives turns any more: an update still running ends (cancelled) freely."""
        self.turns.close()
