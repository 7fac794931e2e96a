"""Run a query stream through the online system: serve each request with speculative decoding,
record its trace, and let the learner update the draft in the background (arXiv 2310.07177, section 4.2).
Each request goes to the draft its router names (:mod:`onlinespec.routing`): by default one draft
per domain, each learning only its own traffic (:mod:`onlinespec.online.pool`).

Writes a JSONL event log as it goes (one line per request, per update start and per update end)
and returns per-request rows and a summary (also per domain, with the moving average of alpha
over the last 50 requests, as the paper reports it).

Side-by-side comparison (``compare_every = N``): every N-th request is also served, in the same
process and right before or after the online system (alternately), by the STARTING draft kept
static and by the target alone, so the three are measured on the same requests under the same
machine load. After the stream, once the learner has stopped, those probe requests are served
again by the static draft and the target alone: the ratio of the two passes is the serving
throughput kept while the learner runs in the background (issue 4's 85% must-show), with the
work held fixed.

A request's row is written to the log only after its training record is in the durable buffer:
a logged request is an acknowledged one, and a restart finds its record.
"""

from __future__ import annotations

import copy
import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from onlinespec.api import DEFAULT_DRAFT, DEFAULT_K, engine_options, make_proposer
from onlinespec.data import Query
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.models import load_model
from onlinespec.online.learner import LearnerConfig
from onlinespec.online.pool import DraftPool, saved_drafts
from onlinespec.routing import MAX_DRAFTS, ROUTERS, Router

MOVING_AVERAGE = 50


@dataclass
class OnlineConfig:
    target: str = "default"
    draft: str = DEFAULT_DRAFT
    k: int = DEFAULT_K
    dtype: str = "float32"
    max_new_tokens: int = 64
    learn: bool = True
    buffer_policy: str = "window"
    buffer_records: int = 2000
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    router: str = "domain"  # domain: one draft per request domain (learning only); single: one shared draft
    max_drafts: int = MAX_DRAFTS  # domains beyond this many share one draft
    adaptive_k: bool = True  # per-round k from the measured cost curve (off: always k proposals)
    kernels: bool = True  # small-batch linear kernels when they measure faster (shared by all decoders)
    compare_every: int = 0  # serve every N-th request also with the static draft and the target alone
    check_learning_off: bool = True  # serve those requests again once the learner has stopped

    def __post_init__(self) -> None:
        if self.compare_every < 0 or self.k < 0 or self.max_new_tokens < 1:
            raise ValueError("compare_every >= 0, k >= 0 and max_new_tokens >= 1 are required")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}: use one of {ROUTERS}")


def moving_average(values: Sequence[float], window: int = MOVING_AVERAGE) -> list[float]:
    """Per position, the mean of the last ``window`` values (as the paper plots alpha)."""
    return [sum(values[max(0, i + 1 - window): i + 1]) / len(values[max(0, i + 1 - window): i + 1]) for i in range(len(values))]


def pooled_alpha(stats: Sequence[dict]) -> float:
    """Accepted over judged proposals, summed over requests (a stats row each)."""
    return sum(s["accepted"] for s in stats) / max(1, sum(s["judged"] for s in stats))


def _stats_row(stats) -> dict:
    return {
        "acceptance_rate": stats.acceptance_rate, "tau": stats.mean_accepted_length, "accepted": stats.accepted,
        "judged": stats.accepted + stats.rejected, "new_tokens": stats.new_tokens, "seconds": stats.seconds,
        "tokens_per_s": stats.tokens_per_s,
    }


def run_stream(
    queries: Sequence[Query],
    config: OnlineConfig,
    out_dir: str | Path,
    on_request: Callable[[dict], None] | None = None,
    on_status: Callable[[str], None] | None = None,
) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    say = on_status or (lambda text: None)
    say("loading the target and the draft")
    target = load_model(config.target, config.dtype)
    say("measuring the target's verify-cost curve")
    options = engine_options(target, config.k, adaptive=config.adaptive_k, kernels=config.kernels) if config.draft != "none" else {}

    def new_decoder() -> SpeculativeDecoder:
        """A fresh starting draft with its own acceptance statistics; same target, same kernels."""
        proposer = make_proposer(config.draft, target, config.dtype).proposer
        return SpeculativeDecoder(target.model, target.tokenizer, proposer, k=config.k,
                                  **dict(options, adaptive_k=copy.deepcopy(options.get("adaptive_k"))))

    static = alone = None
    if config.compare_every:  # the starting draft, never updated, and the target alone
        static, alone = new_decoder(), SpeculativeDecoder(target.model, target.tokenizer, None)

    events = open(out_dir / "events.jsonl", "a")
    write_lock = threading.Lock()

    def log(event: dict) -> None:
        with write_lock:
            events.write(json.dumps({**event, "time": event.get("time", time.time())}) + "\n")
            events.flush()

    rows: list[dict] = []
    router = Router(config.router if config.learn else "single", config.max_drafts, saved_drafts(out_dir) if config.learn else ())
    pool = DraftPool(new_decoder, out_dir, router, config.learner if config.learn else None, config.buffer_policy,
                     config.buffer_records, on_event=lambda event: log({**event, "requests_served": len(rows)}))
    log({"event": "start", "router": router.policy, "learn": config.learn})
    probes: list[tuple[int, Query]] = []
    try:
        for i, query in enumerate(queries):
            params = SamplingParams(max_new_tokens=query.max_new_tokens or config.max_new_tokens)
            prompt = list(query.messages) if query.messages else query.prompt
            draft = pool.route(query.domain)
            probe = bool(config.compare_every) and i % config.compare_every == 0
            # on probe requests the online system goes first on every other one, last on the rest
            before = _probe(static, alone, prompt, params, len(probes)) if probe and len(probes) % 2 else None
            busy, version = pool.busy, draft.version
            out = draft.decoder.generate(prompt, params, trace=draft.learner is not None)
            row = {"i": i, "id": query.id, "domain": query.domain, "draft": draft.name, "draft_version": version,
                   **_stats_row(out.stats), "learner_busy": busy or pool.busy, "time": time.time()}
            if probe:
                outs = before or _probe(static, alone, prompt, params, len(probes))
                row["static"], row["target_alone"] = _stats_row(outs["static"].stats), _stats_row(outs["alone"].stats)
                row["identical"] = outs["static"].token_ids == out.token_ids == outs["alone"].token_ids
                probes.append((len(rows), query))
            rows.append(row)
            row["alpha_moving_average"] = moving_average([r["acceptance_rate"] for r in rows[-MOVING_AVERAGE:]])[-1]
            started = time.perf_counter()
            pool.observe(draft, out, query.domain, query.id, train=query.train)  # durable before the row is logged
            # the online system's time includes recording the request (the static draft records nothing)
            row["record_seconds"] = time.perf_counter() - started
            row["seconds"] += row["record_seconds"]
            row["tokens_per_s"] = row["new_tokens"] / row["seconds"] if row["seconds"] else 0.0
            log({"event": "request", **row})
            if on_request:
                on_request(row)
        if pool.learners:
            say("waiting for the update in flight, then running the updates still due")
            pool.wait(drain=True)
        if probes and pool.learners and config.check_learning_off:
            say(f"serving the {len(probes)} probe requests again with the learner stopped")
            for n, (index, query) in enumerate(probes):
                params = SamplingParams(max_new_tokens=query.max_new_tokens or config.max_new_tokens)
                prompt = list(query.messages) if query.messages else query.prompt
                outs = _probe(static, alone, prompt, params, n)
                rows[index]["static_learning_off"], rows[index]["target_alone_learning_off"] = (_stats_row(outs[name].stats) for name in ("static", "alone"))
    finally:
        events.close()
    return summarize(rows, config, pool)


def _probe(static: SpeculativeDecoder, alone: SpeculativeDecoder, prompt, params: SamplingParams, turn: int) -> dict:
    """Serve one request with the static draft and with the target alone (alternating which goes first)."""
    order = [("static", static), ("alone", alone)][:: 1 if turn % 2 == 0 else -1]
    return {name: decoder.generate(prompt, params) for name, decoder in order}


def _throughput(rows: list[dict], key: str | None = None) -> float:
    part = [r[key] if key else r for r in rows]
    seconds = sum(p["seconds"] for p in part)
    return sum(p["new_tokens"] for p in part) / seconds if seconds else 0.0


def _median_ratio(rows: list[dict], a: str | None, b: str) -> float:
    ratios = [(r[a] if a else r)["tokens_per_s"] / r[b]["tokens_per_s"] for r in rows if r[b]["tokens_per_s"]]
    return statistics.median(ratios) if ratios else 0.0


def bootstrap_ratio(rows: list[dict], a: str | None, b: str, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% interval of pooled tokens/s ``a`` / ``b`` over the requests, resampled with
    replacement (paired: each request keeps both its measurements), with a fixed seed."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        sample = [rng.choice(rows) for _ in rows]
        ratios.append(_throughput(sample, a) / _throughput(sample, b))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def summarize(rows: list[dict], config: OnlineConfig, pool: DraftPool | None = None) -> dict:
    def figures(part: list[dict]) -> dict:
        head, tail = part[:MOVING_AVERAGE], part[-MOVING_AVERAGE:]
        return {
            "n_requests": len(part),
            "tokens_per_s": _throughput(part),
            "acceptance_rate_mean": sum(r["acceptance_rate"] for r in part) / len(part),
            "acceptance_rate_pooled": pooled_alpha(part),
            "acceptance_rate_first_50": sum(r["acceptance_rate"] for r in head) / len(head),
            "acceptance_rate_last_50": sum(r["acceptance_rate"] for r in tail) / len(tail),
            "tau_mean": sum(r["tau"] for r in part) / len(part),
        }

    domains = list(dict.fromkeys(r["domain"] for r in rows))
    result = {
        "config": asdict(config),
        "summary": figures(rows) if rows else {},
        "domains": {d: figures([r for r in rows if r["domain"] == d]) for d in domains},
        "updates": [{"draft": name, **asdict(r)} for name, r in pool.reports()] if pool else [],
        "requests": rows,
    }
    probed = [r for r in rows if "static" in r]
    if probed:
        comparison = {
            "n_requests": len(probed),
            "identical": sum(bool(r["identical"]) for r in probed),
            "tokens_per_s": {"online": _throughput(probed), "static": _throughput(probed, "static"),
                             "target_alone": _throughput(probed, "target_alone")},
            "median_ratio": {"online/target_alone": _median_ratio(probed, None, "target_alone"),
                             "static/target_alone": _median_ratio(probed, "static", "target_alone"),
                             "online/static": _median_ratio(probed, None, "static")},
            "online/static_95ci": bootstrap_ratio(probed, None, "static"),
            "acceptance_rate": {"online": figures(probed)["acceptance_rate_pooled"],
                                "static": sum(r["static"]["accepted"] for r in probed) / max(1, sum(r["static"]["judged"] for r in probed))},
        }
        off = [r for r in probed if "static_learning_off" in r]
        if off:  # the same probe requests, with the learner running vs stopped
            comparison["learning_on_vs_off"] = {
                "static": _throughput(off, "static") / _throughput(off, "static_learning_off"),
                "target_alone": _throughput(off, "target_alone") / _throughput(off, "target_alone_learning_off"),
                "static_median_ratio": _median_ratio(off, "static", "static_learning_off"),
                "target_alone_median_ratio": _median_ratio(off, "target_alone", "target_alone_learning_off"),
                "requests_with_learner_busy": sum(r["learner_busy"] for r in off),
            }
        result["comparison"] = comparison
    return result
