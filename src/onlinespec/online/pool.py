"""The drafts a stream is served with (arXiv 2310.07177, section 4.3): one per name the router gives, each
with its own proposer, decoder (its own adaptive-k statistics), replay buffer, registry and
learner, all under one output folder::

    drafts/<name>/   the draft's registry (versions, CURRENT)
    buffer/<name>/   its replay buffer

A draft is created the first time the router names it, from the starting draft, or, after a
restart, from the last version its registry published. The learners share one update slot: one
update runs at a time, with the whole learner CPU budget, and an update that falls due while
another draft's runs starts as soon as the slot is free (checked after every request).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from onlinespec.decoding.speculative import Generation, SpeculativeDecoder
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learner import LearnerConfig, OnlineLearner, UpdateReport
from onlinespec.online.registry import DraftRegistry
from onlinespec.routing import Router


@dataclass
class Draft:
    name: str
    decoder: SpeculativeDecoder
    learner: OnlineLearner | None

    @property
    def version(self) -> str | None:
        return getattr(self.decoder.proposer, "version", None)


def saved_drafts(out_dir: str | Path) -> list[str]:
    """The drafts that a previous run in ``out_dir`` published, oldest first (a restart routes
    their domains to them again)."""
    root = Path(out_dir) / "drafts"
    found = [p for p in root.iterdir() if (p / "CURRENT").exists()] if root.is_dir() else []
    return [p.name for p in sorted(found, key=lambda p: (p / "v0001").stat().st_mtime if (p / "v0001").exists() else 0)]


class DraftPool:
    def __init__(
        self,
        new_decoder: Callable[[], SpeculativeDecoder],
        out_dir: str | Path,
        router: Router | None = None,
        learner: LearnerConfig | None = None,
        buffer_policy: str = "window",
        buffer_records: int = 2000,
        on_event: Callable[[dict], None] | None = None,
    ) -> None:
        """``new_decoder()`` builds a decoder around a fresh starting draft; ``learner=None``
        serves every draft static (no buffer, no registry)."""
        self.out_dir = Path(out_dir)
        self.new_decoder, self.learner_config = new_decoder, learner
        self.buffer_policy, self.buffer_records = buffer_policy, buffer_records
        self.on_event = on_event or (lambda event: None)
        self.router = router or Router("single")
        self.drafts: dict[str, Draft] = {}
        self._slot = threading.Semaphore(1)

    def route(self, domain: str) -> Draft:
        """The draft that serves a request of ``domain`` (created on first use)."""
        name = self.router(domain)
        if name not in self.drafts:
            self.drafts[name] = self._create(name)
        return self.drafts[name]

    def _create(self, name: str) -> Draft:
        decoder = self.new_decoder()
        learner = None
        if self.learner_config is not None:
            if not hasattr(decoder.proposer, "swap_model"):
                raise ValueError(f"online learning needs a learned draft (a draft LM, a head or a hybrid), not {getattr(decoder.proposer, 'name', 'none')!r}")
            buffer = ReplayBuffer(self.out_dir / "buffer" / name, self.buffer_policy, max_records=self.buffer_records)
            registry = DraftRegistry(self.out_dir / "drafts" / name)
            learner = OnlineLearner(decoder.proposer, buffer, registry, self.learner_config,
                                    on_event=lambda event: self.on_event({**event, "draft": name}), slot=self._slot)
            self.on_event({"event": "draft", "draft": name, "draft_version": decoder.proposer.version,
                           "buffer_records": len(buffer)})
        return Draft(name, decoder, learner)

    def observe(self, draft: Draft, generation: Generation, domain: str, request_id: str, train: bool = True) -> None:
        """Record a served request with its draft's learner; then, if the slot is free, start the
        update that has waited longest for it (first due, first served: none waits for ever)."""
        if draft.learner is None:
            return
        draft.learner.observe(generation, domain, request_id, train, start=False)
        self._start_next()

    def _start_next(self) -> bool:
        waiting = [learner for learner in self.learners if learner.due]
        return bool(waiting) and min(waiting, key=lambda learner: learner.due_since).maybe_update()

    @property
    def learners(self) -> list[OnlineLearner]:
        return [d.learner for d in self.drafts.values() if d.learner is not None]

    @property
    def busy(self) -> bool:
        return any(learner.busy for learner in self.learners)

    def wait(self, drain: bool = False) -> None:
        """Block until the updates in flight end (shutdown; serving never waits); with ``drain``,
        then run the updates still due, one after another (the end of a stream)."""
        while True:
            for learner in self.learners:
                learner.wait()
            if not (drain and self._start_next()):
                return

    def reports(self) -> list[tuple[str, UpdateReport]]:
        """Every update of every draft, as (draft name, report), in the order they ended."""
        tagged = [(name, r) for name, d in self.drafts.items() if d.learner for r in d.learner.reports]
        return sorted(tagged, key=lambda pair: pair[1].ended_at)
