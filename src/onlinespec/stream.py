"""Drive a query stream through the serving core while its drafts learn (arXiv 2310.07177, section 4.2).

The core (:mod:`onlinespec.serve.core`) does the serving, recording and learning; this module is
a client of it that sends a stream with ``concurrency`` requests in flight and measures. Two
transports, one driver (:func:`drive`): :class:`CoreClient` submits in process (``onlinespec
online``), :class:`HTTPClient` sends through the OpenAI API of a running server with the real
``openai`` client (``onlinespec demo``).

Side-by-side comparison (``compare_every = N``): every N-th request (a probe) is also served by the
STARTING draft kept static (draft ``"static"``), right before or after the online one (alternately),
under the same load. After the stream, learning is paused, the update in flight ends, and the
probes are served again at the same concurrency: first in the same pairs (the online draft, by
name and not learnt from, beside the static draft), so that the static draft's two passes differ
in the learner only and give the serving throughput kept while it runs; then by the target alone
(draft ``"none"``), in batches of its own, as a server without speculation would run them.

With ``fresh``, every probe is served a third time, by the draft born from nothing (draft
``"fresh"``, ``serve --fresh-baseline``: the same kind of draft without the packaged head), which
learns from the probes it serves: the cold start of a model with no trained draft, live beside the
packaged head on the same requests.

Each request's row (``on_request``) comes after its training record is in the durable buffer: a
reported request is an acknowledged one. A request that fails (refused, timed out, a server
error) is an error row with its message: it is counted and left out of the figures, and the
stream goes on.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

from onlinespec.data import Query
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.factory import FRESH
from onlinespec.metrics import bootstrap_ratio, median_ratio, moving_average
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore
from onlinespec.serve.handles import STATIC, TARGET_ALONE, Served

MOVING_AVERAGE = 50
LEARNING = (None, FRESH)  # the drafts a stream's requests train: the routed one, and the fresh baseline
STATS = ("acceptance_rate", "tau", "accepted", "judged", "new_tokens", "seconds", "tokens_per_s")


@dataclass
class OnlineConfig:
    core: CoreConfig = field(default_factory=CoreConfig)
    max_new_tokens: int = 64  # per request, unless the query says
    concurrency: int = 1  # requests in flight
    compare_every: int = 0  # serve every N-th request also with the static draft (and, after, the target alone)
    fresh: bool = False  # and with the draft born from nothing (draft "fresh"), which learns from those requests

    def __post_init__(self) -> None:
        if self.compare_every < 0 or self.max_new_tokens < 1 or self.concurrency < 1:
            raise ValueError("compare_every >= 0, max_new_tokens >= 1 and concurrency >= 1 are required")
        if self.fresh and not self.compare_every:
            raise ValueError("the fresh draft serves the compared requests: give compare_every >= 1")


class StreamClient(Protocol):
    def serve(self, query: Query, max_new_tokens: int, draft: str | None = None) -> dict:
        """Serve one query greedily (``draft``: a baseline by name); its row: STATS, text, draft, version, learner_busy."""

    def settle(self) -> None:
        """Pause learning and wait for the update in flight to end."""

    def updates(self) -> list[dict]:
        """Every update of every draft, in the order they ended."""

    def health(self) -> dict:
        """The training data's governance counts and the learners' failures (:func:`learner_health`)."""


def learner_health(drafts: list[dict], governance: dict | None, learning: dict | None = None) -> dict:
    """From :meth:`ServingCore.drafts` rows (or ``GET /admin/drafts``): failed updates and
    stopped learners by draft, the governance counts, and the engine time learning took."""
    return {"governance": governance or {}, "learning": learning or {},
            "update_failures": {d["name"]: d["failures"] for d in drafts if d.get("failures")},
            "learners_stopped": {d["name"]: d["stopped"] for d in drafts if d.get("stopped")}}


def stream_row(text: str, metrics: dict, new_tokens: int, seconds: float) -> dict:
    """A served request's row, from its response's ``metrics`` (:meth:`Served.metrics`)."""
    spec = metrics["speculative_decoding"]
    return {
        "text": text, "acceptance_rate": spec["alpha"], "tau": spec["tokens_per_target_forward"],
        "accepted": spec["num_accepted_tokens"], "judged": spec["num_judged_tokens"], "new_tokens": new_tokens,
        "seconds": seconds, "tokens_per_s": new_tokens / seconds if seconds else 0.0, "by_drafter": spec.get("by_drafter", {}),
        "draft": spec["draft"],
        "draft_version": spec["draft_version"], "learner_busy": metrics["learner_busy"],
    }


class CoreClient:
    """A stream client in the core's own process."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    def serve(self, query: Query, max_new_tokens: int, draft: str | None = None) -> dict:
        started = time.perf_counter()
        prompt = list(query.messages) if query.messages else query.prompt
        handle = self.core.submit(prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), query.domain,
                                  train=query.train and draft in LEARNING, draft=draft, request_id=query.id)
        served: Served = handle.result()
        seconds = time.perf_counter() - started  # what the client waited, recording included
        return stream_row(served.text, served.metrics(), served.completion_tokens, seconds)

    def settle(self) -> None:
        if self.core.config.learning:
            self.core.operate("pause")
        for learner in self.core.pool.learners:
            learner.wait()

    def updates(self) -> list[dict]:
        return [{"draft": name, **asdict(r)} for name, r in self.core.pool.reports()]

    def health(self) -> dict:
        return learner_health(self.core.drafts(), self.core.governance(), self.core.learning())


class HTTPClient:
    """A stream client of a running server, through the real ``openai`` client (and its admin API)."""

    def __init__(self, url: str, model: str = "default", api_key: str = "none", admin_key: str | None = None,
                 timeout: float = 900.0) -> None:
        import httpx
        import openai

        self.model, self.url = model, url.rstrip("/")
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, timeout=timeout, max_retries=0)
        self.admin = httpx.Client(base_url=self.url, timeout=timeout,
                                  headers={"Authorization": f"Bearer {admin_key}"} if admin_key else {})

    def serve(self, query: Query, max_new_tokens: int, draft: str | None = None) -> dict:
        extra = {"domain": query.domain, "train": query.train and draft in LEARNING, **({"draft": draft} if draft else {})}
        common = dict(model=self.model, max_tokens=max_new_tokens, temperature=0.0, extra_body=extra,
                      extra_headers={"X-Request-Id": query.id})
        started = time.perf_counter()
        if query.messages:
            response = self.openai.chat.completions.create(messages=list(query.messages), **common)
            text = response.choices[0].message.content
        else:
            response = self.openai.completions.create(prompt=query.prompt, **common)
            text = response.choices[0].text
        seconds = time.perf_counter() - started
        return stream_row(text, response.model_extra["metrics"], response.usage.completion_tokens, seconds)

    def settle(self) -> None:
        state = self.admin.get("/admin/drafts").raise_for_status().json()
        if state["learning"] and state["learning"]["learning"]:
            self.admin.post("/admin/learning/pause").raise_for_status()
        while any(d.get("busy") for d in self.admin.get("/admin/drafts").raise_for_status().json()["drafts"]):
            time.sleep(0.5)

    def updates(self) -> list[dict]:
        drafts = self.admin.get("/admin/drafts").raise_for_status().json()["drafts"]
        return sorted(({"draft": d["name"], **u} for d in drafts for u in d.get("updates", [])), key=lambda u: u["ended_at"])

    def health(self) -> dict:
        state = self.admin.get("/admin/drafts").raise_for_status().json()
        return learner_health(state["drafts"], state.get("governance"), state.get("learning"))


def run_stream(
    queries: Sequence[Query],
    config: OnlineConfig,
    out_dir: str | Path,
    on_request: Callable[[dict], None] | None = None,
    on_status: Callable[[str], None] | None = None,
) -> dict:
    """Serve ``queries`` through a serving core in this process (``onlinespec online``)."""
    say = on_status or (lambda text: None)
    say("loading the target and the draft, measuring the target's cost curve")
    core_config = replace(config.core, speculation_details=True)  # the operator's own stream: its report shows the drafters
    if config.compare_every and not core_config.static_baseline:
        core_config = replace(core_config, static_baseline=True)
    if config.fresh:
        core_config = replace(core_config, fresh_baseline=True)
    core = ServingCore(core_config, out_dir)
    try:
        core.load()
        return drive(queries, CoreClient(core), config, on_request, say)
    finally:
        core.shutdown()


def drive(
    queries: Sequence[Query],
    client: StreamClient,
    config: OnlineConfig,
    on_request: Callable[[dict], None] | None = None,
    say: Callable[[str], None] = lambda text: None,
) -> dict:
    """Send ``queries`` through ``client``, ``config.concurrency`` in flight; measure as the
    module docstring says; return :func:`summarize`'s result."""
    run = _StreamRun(queries, client, config, on_request)
    run.in_parallel(run.serve, range(len(queries)))
    rows = sorted(run.rows, key=lambda r: r["i"])
    probes = [r for r in rows if "static" in r]
    if probes:
        say("learning paused: waiting for the update in flight to end")
        client.settle()
        for step, what in ((run.learning_off, "online and static drafts"), (run.target_alone, "target alone")):
            say(f"serving the {len(probes)} compared requests again, learning paused: {what}")
            run.in_parallel(step, probes)
        for r in probes:  # greedy: the online system, the static draft and the target alone agree
            texts = r.pop("texts")
            r["identical"] = TARGET_ALONE in texts and r["text"] == texts[STATIC] == texts[TARGET_ALONE] == texts.get(FRESH, r["text"])
    for r in rows:  # the text itself is not kept; its digest lets runs over the same stream be compared
        text = r.pop("text", None)
        if text is not None:
            r["text_sha256"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return summarize(rows, config, client.updates(), client.health())


class _StreamRun:
    """The requests of one :func:`drive`: the stream (:meth:`serve`, a row each), then its probes
    again with learning paused (:meth:`learning_off`, :meth:`target_alone`)."""

    def __init__(self, queries: Sequence[Query], client: StreamClient, config: OnlineConfig,
                 on_request: Callable[[dict], None] | None) -> None:
        self.queries, self.client, self.config, self.on_request = queries, client, config, on_request
        self.rows: list[dict] = []
        self._lock = threading.Lock()

    def in_parallel(self, fn: Callable, items) -> None:
        with ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="onlinespec-client") as pool:
            list(pool.map(fn, items))

    def _serve(self, i: int, draft: str | None = None) -> dict:
        query = self.queries[i]
        return self.client.serve(query, query.max_new_tokens or self.config.max_new_tokens, draft)

    def _pair(self, i: int, online_draft: str | None = None) -> tuple[dict, dict]:
        """Request ``i`` served by ``online_draft`` (default: routed, and learnt from) and by the static
        draft, the static one first on every other probe."""
        static = self._serve(i, STATIC) if (i // self.config.compare_every) % 2 else None
        online = self._serve(i, online_draft)
        return online, static or self._serve(i, STATIC)

    def serve(self, i: int) -> None:
        """Request ``i`` of the stream (a probe: paired with the static draft); its row, or an error row."""
        query, every = self.queries[i], self.config.compare_every
        row = {"i": i, "id": query.id, "domain": query.domain}
        try:
            if every and i % every == 0:
                online, static = self._pair(i)
                row.update(online, static={k: static[k] for k in STATS}, texts={STATIC: static["text"]})
                if self.config.fresh:
                    fresh = self._serve(i, FRESH)
                    row.update(fresh={k: fresh[k] for k in STATS})
                    row["texts"][FRESH] = fresh["text"]
            else:
                row.update(self._serve(i))
        except Exception as err:  # one failed request is an error row, never the end of the stream
            row = {"i": i, "id": query.id, "domain": query.domain, "error": f"{type(err).__name__}: {err}"}
        row["time"] = time.time()
        ok = [r for r in self.rows[-MOVING_AVERAGE:] if "error" not in r] + ([] if "error" in row else [row])
        with self._lock:
            row["alpha_moving_average"] = moving_average([r["acceptance_rate"] for r in ok], MOVING_AVERAGE)[-1] if ok else 0.0
            self.rows.append(row)
            if self.on_request:
                self.on_request(row)

    def learning_off(self, row: dict) -> None:
        """A probe again, learning paused, in the same pairing as before: the static draft's two
        passes differ in the learner only."""
        try:
            online, static = self._pair(row["i"], row["draft"])
        except Exception as err:
            row["probe_error"] = f"{type(err).__name__}: {err}"
            return
        row["online_learning_off"], row["static_learning_off"] = ({k: out[k] for k in STATS} for out in (online, static))

    def target_alone(self, row: dict) -> None:
        try:
            out = self._serve(row["i"], TARGET_ALONE)
        except Exception as err:
            row["probe_error"] = f"{type(err).__name__}: {err}"
            return
        row["target_alone"] = {k: out[k] for k in STATS}
        row["texts"][TARGET_ALONE] = out["text"]


def pooled_alpha(stats: Sequence[dict]) -> float:
    """Accepted over judged proposals, summed over requests (a stats row each)."""
    return sum(s["accepted"] for s in stats) / max(1, sum(s["judged"] for s in stats))


def _throughput(part: Sequence[dict]) -> float:
    seconds = sum(p["seconds"] for p in part)
    return sum(p["new_tokens"] for p in part) / seconds if seconds else 0.0


def _pick(rows: Sequence[dict], key: str | None) -> list[dict]:
    return [r[key] if key else r for r in rows]


def _rate_pairs(rows: Sequence[dict], a: str | None, b: str) -> list[tuple[float, float]]:
    return [((r[a] if a else r)["tokens_per_s"], r[b]["tokens_per_s"]) for r in rows]


def _interval(rows: Sequence[dict], a: str | None, b: str) -> tuple[float, float]:
    samples = [((r[a] if a else r)["new_tokens"], (r[a] if a else r)["seconds"], r[b]["new_tokens"], r[b]["seconds"]) for r in rows]
    return bootstrap_ratio(samples)


def summarize(rows: list[dict], config: OnlineConfig, updates: list[dict] | None = None, health: dict | None = None) -> dict:
    """The run's results: figures over the requests that succeeded (overall and by domain), the
    errors, the updates, the learners' health and the training data's governance, and the
    side-by-side comparison of the probes."""
    failed = [r for r in rows if "error" in r]
    served = [r for r in rows if "error" not in r]
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

    domains = list(dict.fromkeys(r["domain"] for r in served))
    health = health or {}
    result = {
        "config": asdict(config),
        "summary": {**(figures(served) if served else {"n_requests": 0}), "n_errors": len(failed)},
        "domains": {d: figures([r for r in served if r["domain"] == d]) for d in domains},
        "errors": [{"i": r["i"], "id": r["id"], "error": r["error"]} for r in failed],
        "updates": updates or [],
        "learner": {"update_failures": health.get("update_failures", {}), "learners_stopped": health.get("learners_stopped", {}),
                    "learning": health.get("learning", {})},
        "governance": health.get("governance", {}),
        "requests": rows,
    }
    probed = [r for r in served if "static" in r and "target_alone" in r]
    if probed:
        comparison = {
            "n_requests": len(probed),
            "identical": sum(bool(r.get("identical")) for r in probed),
            "tokens_per_s": {"online": _throughput(probed), "static": _throughput(_pick(probed, "static")),
                             "target_alone": _throughput(_pick(probed, "target_alone"))},
            "median_ratio": {"online/target_alone": median_ratio(_rate_pairs(probed, None, "target_alone")),
                             "static/target_alone": median_ratio(_rate_pairs(probed, "static", "target_alone")),
                             "online/static": median_ratio(_rate_pairs(probed, None, "static"))},
            "online/static_95ci": _interval(probed, None, "static"),
            "acceptance_rate": {"online": pooled_alpha(probed), "static": pooled_alpha(_pick(probed, "static"))},
        }
        off = [r for r in probed if "static_learning_off" in r]
        if off:  # the same requests and draft, with the learner running vs paused
            comparison["learning_on_vs_off"] = {
                "static": _throughput(_pick(off, "static")) / _throughput(_pick(off, "static_learning_off")),
                "static_median_ratio": median_ratio(_rate_pairs(off, "static", "static_learning_off")),
                "requests_with_learner_busy": sum(bool(r["learner_busy"]) for r in off),
            }
        fresh = [r for r in probed if "fresh" in r]
        if fresh:  # the draft born from nothing, on the same requests (the fresh baseline)
            comparison["tokens_per_s"]["fresh"] = _throughput(_pick(fresh, "fresh"))
            comparison["acceptance_rate"]["fresh"] = pooled_alpha(_pick(fresh, "fresh"))
            tail = fresh[-MOVING_AVERAGE:]
            comparison["last_50_compared"] = {"online": pooled_alpha(tail), "static": pooled_alpha(_pick(tail, "static")),
                                              "fresh": pooled_alpha(_pick(tail, "fresh"))}
        result["comparison"] = comparison
    return result
