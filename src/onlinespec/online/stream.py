"""Run a query stream through the online system: serve each request with speculative decoding,
record its trace, and let the learner update the draft in the background (PAPER.md section 3).

Writes a JSONL event log (one line per request and per draft update) as it goes, and returns
per-request rows and a summary (also per domain, with the moving average of alpha over the last
50 requests, as the paper reports it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from onlinespec.api import make_proposer
from onlinespec.data import Query
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.models import load_model
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learner import LearnerConfig, OnlineLearner
from onlinespec.online.registry import DraftRegistry

MOVING_AVERAGE = 50


@dataclass
class OnlineConfig:
    target: str = "default"
    draft: str = "target-layers:2"
    k: int = 2
    dtype: str = "float32"
    max_new_tokens: int = 64
    learn: bool = True
    buffer_policy: str = "window"
    buffer_records: int = 2000
    learner: LearnerConfig = field(default_factory=LearnerConfig)


def run_stream(
    queries: Sequence[Query],
    config: OnlineConfig,
    out_dir: str | Path,
    on_request: Callable[[dict], None] | None = None,
) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = load_model(config.target, config.dtype)
    proposer = make_proposer(config.draft, target, config.dtype).proposer
    if config.learn and not hasattr(proposer, "swap_model"):
        raise ValueError(f"online learning needs a learned draft (a draft LM, a head or a hybrid), not {config.draft!r}")
    decoder = SpeculativeDecoder(target.model, target.tokenizer, proposer, k=config.k)
    learner = None
    if config.learn:
        buffer = ReplayBuffer(out_dir / "buffer", config.buffer_policy, max_records=config.buffer_records)
        learner = OnlineLearner(proposer, buffer, DraftRegistry(out_dir / "drafts"), config.learner)
    rows: list[dict] = []
    logged = 0  # update reports already written to the event log

    def log_updates(events, after_request: int) -> None:
        nonlocal logged
        for report in learner.reports[logged:]:
            events.write(json.dumps({"event": "update", "after_request": after_request, **asdict(report)}) + "\n")
        logged = len(learner.reports)

    with open(out_dir / "events.jsonl", "a") as events:
        for i, query in enumerate(queries):
            params = SamplingParams(max_new_tokens=query.max_new_tokens or config.max_new_tokens)
            out = decoder.generate(list(query.messages) if query.messages else query.prompt, params, trace=learner is not None)
            stats = out.stats
            row = {
                "i": i, "id": query.id, "domain": query.domain, "acceptance_rate": stats.acceptance_rate,
                "mean_accepted_length": stats.mean_accepted_length, "draft_version": proposer.version,
                "new_tokens": stats.new_tokens, "seconds": stats.seconds, "tokens_per_s": stats.tokens_per_s,
                "time": time.time(),
            }
            window = rows[-(MOVING_AVERAGE - 1):] + [row]
            row["alpha_moving_average"] = sum(r["acceptance_rate"] for r in window) / len(window)
            rows.append(row)
            events.write(json.dumps({"event": "request", **row}) + "\n")
            if learner is not None:
                learner.observe(out, query.domain, query.id, train=query.train)
                log_updates(events, i)
            events.flush()
            if on_request:
                on_request(row)
        if learner is not None:
            learner.wait()
            log_updates(events, len(queries) - 1)
    return summarize(rows, config, learner)


def summarize(rows: list[dict], config: OnlineConfig, learner: OnlineLearner | None) -> dict:
    def figures(part: list[dict]) -> dict:
        tokens, seconds = sum(r["new_tokens"] for r in part), sum(r["seconds"] for r in part)
        head, tail = part[:MOVING_AVERAGE], part[-MOVING_AVERAGE:]
        return {
            "n_requests": len(part),
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "acceptance_rate_mean": sum(r["acceptance_rate"] for r in part) / len(part),
            "acceptance_rate_first_50": sum(r["acceptance_rate"] for r in head) / len(head),
            "acceptance_rate_last_50": sum(r["acceptance_rate"] for r in tail) / len(tail),
        }

    domains = list(dict.fromkeys(r["domain"] for r in rows))
    return {
        "config": asdict(config),
        "summary": figures(rows),
        "domains": {d: figures([r for r in rows if r["domain"] == d]) for d in domains},
        "updates": [asdict(r) for r in learner.reports] if learner else [],
        "requests": rows,
    }
