"""Prometheus metrics of a serving core, under vLLM's names with our own prefix.

The spec-decode counters are vLLM's (``spec_decode_num_drafts_total``,
``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total``,
``spec_decode_num_accepted_tokens_per_pos_total{position}``), labelled by draft, draft version and
domain: an operator sees, per published version, whether acceptance rose. Latency histograms,
queue gauges and the learner's counters come beside them. Each core has its own registry, so
several cores (tests, replicas) never share counters.

vLLM's own series (``vllm:``, labelled ``model_name``: :mod:`onlinespec.serve.vllm_metrics`)
are fed by the same calls (:meth:`ServeMetrics.request`, :meth:`~ServeMetrics.batch`,
:meth:`~ServeMetrics.inter_token`): one recording point, two families.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from onlinespec import memory
from onlinespec.serve.vllm_metrics import VllmMetrics

PREFIX = "onlinespec:"
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
SPEC = ("draft", "version", "domain")
KEEP_VERSIONS = 2  # per draft, the versions whose spec-decode series /metrics keeps (the serving one and the one before)


class MemoryCollector(Collector):
    """The process's memory budget (:mod:`onlinespec.memory`) at each scrape: the budget, the bytes
    used and the evictions, by holder kind (fixed labels: ``replay_buffer``, ``suffix_index``,
    ``draft``; never a client's name)."""

    def collect(self):
        budget = memory.budget()
        yield GaugeMetricFamily(PREFIX + "memory_budget_bytes", "Bytes the replay buffers, suffix indexes, drafts and prefix-cache cells may "
                                "hold together (--memory-budget)", value=budget.limit)
        used = GaugeMetricFamily(PREFIX + "memory_used_bytes", "Bytes held, by kind of holder", labels=["kind"])
        evictions = CounterMetricFamily(PREFIX + "memory_evictions", "Records (replay_buffer) or documents (suffix_index) "
                                        "the memory budget evicted, by kind of holder", labels=["kind"])
        evicted = CounterMetricFamily(PREFIX + "memory_evicted_bytes", "Bytes the memory budget's evictions freed, by kind",
                                      labels=["kind"])
        for kind, value in budget.used().items():
            used.add_metric([kind], value)
            evictions.add_metric([kind], budget.evictions[kind])
            evicted.add_metric([kind], budget.evicted_bytes[kind])
        yield from (used, evictions, evicted)


def _name(name: str) -> str:
    return PREFIX + name


class ServeMetrics:
    def __init__(self, model_name: str = "default") -> None:
        """``model_name``: the served model's name, the ``model_name`` label of the ``vllm:`` series."""
        self.registry = r = CollectorRegistry()
        name = _name
        self.num_drafts = Counter(name("spec_decode_num_drafts"), "Rounds that sent proposals", SPEC, registry=r)
        self.num_draft_tokens = Counter(name("spec_decode_num_draft_tokens"), "Proposed tokens", SPEC, registry=r)
        self.num_accepted_tokens = Counter(name("spec_decode_num_accepted_tokens"), "Accepted proposals", SPEC, registry=r)
        self.accepted_per_pos = Counter(name("spec_decode_num_accepted_tokens_per_pos"),
                                        "Accepted proposals by position in the draft", (*SPEC, "position"), registry=r)
        self.requests = Counter(name("request_success"), "Finished requests by finish reason", ("finished_reason",), registry=r)
        self.failures = Counter(name("request_failure"), "Requests that ended without an answer", ("reason",), registry=r)
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(name("generation_tokens"), "Generated tokens", SPEC, registry=r)
        self.latency = Histogram(name("e2e_request_latency_seconds"), "From arrival to the last token", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(name("request_queue_time_seconds"), "Waiting for a batch slot", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(name("time_to_first_token_seconds"), "From arrival to the first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(name("inter_token_latency_seconds"), "Between tokens (a round's tokens share its wait)", buckets=TOKEN_BUCKETS, registry=r)
        self.running = Gauge(name("num_requests_running"), "Requests in the batch", registry=r)
        self.waiting = Gauge(name("num_requests_waiting"), "Requests waiting for a slot", registry=r)
        self._learning_series(r)
        self._routing_series(r)
        self._cost_series(r)
        self.vllm = VllmMetrics(r, model_name)
        r.register(MemoryCollector())  # issue 46: the memory budget, read at each scrape
        self._versions: dict[str, str] = {}
        self._series: dict[str, dict[str, set[tuple]]] = {}  # draft -> version -> the label tuples its requests made

    def _learning_series(self, r: CollectorRegistry) -> None:
        """The learners', replay buffers' and suffix indexes' series."""
        name = _name
        self.updates = Counter(name("learner_updates"), "Draft updates by outcome", ("draft", "outcome"), registry=r)
        self.learn_share = Gauge(name("learn_share"), "Share of the engine's wall time spent learning (last 30 s, "
                                 "onlinespec.online.turns)", registry=r)
        self.learn_share_limit = Gauge(name("learn_share_limit"), "The most of the engine's time learning may take under load",
                                       registry=r)
        self.learn_headroom = Gauge(name("learn_headroom"), "Share of the engine's serving time (last 30 s) at batch sizes "
                                    "where a draft could pay at all: learning and recording under load scale with it", registry=r)
        self.learn_seconds = Counter(name("learn_seconds"), "Engine seconds given to learning", registry=r)
        self.update_seconds = Histogram(name("learner_update_seconds"), "Wall time of one update", ("draft",),
                                        buckets=(1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640), registry=r)
        self.buffer_records = Gauge(name("buffer_records"), "Records in the draft's replay buffer", ("draft",), registry=r)
        self.buffer_bytes = Gauge(name("buffer_bytes"), "Bytes of the draft's replay buffer", ("draft",), registry=r)
        self.records = Counter(name("buffer_records_written"), "Training records written (durable)", ("draft",), registry=r)
        self.suffix_tokens = Gauge(name("suffix_index_tokens"), "Tokens in the draft's suffix index of earlier requests", ("draft",), registry=r)
        self.record_failures = Counter(name("buffer_record_write_failures"), "Records a failed disk write skipped (serving went on)",
                                       ("draft",), registry=r)
        self.housekeeping_failures = Counter(name("housekeeping_failures"), "Housekeeping ticks that raised (retention, "
                                             "versions another process published): it goes on", registry=r)
        self.opted_out = Counter(name("requests_opted_out"), "Served requests that asked not to be trained on (nothing stored)",
                                 registry=r)
        self.learner_stopped = Gauge(name("learner_stopped"), "1 while a draft's learner has stopped after failures", ("draft",), registry=r)
        self.version = Gauge(name("draft_version_info"), "1 for the version each draft serves", ("draft", "version"), registry=r)

    def _routing_series(self, r: CollectorRegistry) -> None:
        """Content routing's series."""
        name = _name
        self.drift = Counter(name("drift_detections"), "Content routing: detected changes (prompts: unlike the clusters; "
                             "alpha: a cluster's served alpha fell; new_cluster: a cluster went live; returned: a cluster's traffic came back)", ("kind",), registry=r)
        self.lifecycle = Counter(name("draft_lifecycle"), "Content routing: drafts spawned, evicted, reloaded, retired (merged)",
                                 ("action",), registry=r)
        self.unscored = Counter(name("routing_requests_unscored"), "Content routing: requests the scorer fell too far behind "
                                "to score (its backlog's oldest)", registry=r)
        self.clusters = Gauge(name("routing_clusters"), "Content routing: live prompt clusters", registry=r)
        self.in_memory = Gauge(name("drafts_in_memory"), "Content routing: drafts loaded (at most --max-drafts)", registry=r)

    def _cost_series(self, r: CollectorRegistry) -> None:
        """The cost model's c per drafter."""
        name = _name
        # The cost model's c per drafter (Proposal.drafter: ngram, suffix, head, ...): the draft
        # seconds per drafted token over one step of the target alone (docs/cpu-speculation.md).
        # A batched step's draft call is shared by its rows: each row counts its share.
        self.draft_seconds = Counter(name("draft_seconds"), "Draft-call seconds, each row's share of its step's call",
                                     ("drafter",), registry=r)
        self.drafted_tokens = Counter(name("drafted_tokens"), "Tokens drafted", ("drafter",), registry=r)
        self.target_step_seconds = Gauge(name("target_step_seconds"), "One decoding step of the target alone at batch 1 "
                                         "(the calibrated cost curve; 0 until measured)", registry=r)
        self.draft_cost = Gauge(name("draft_cost_ratio"), "c: draft seconds per drafted token over one step of the target "
                                "alone, since start (needs target_step_seconds)", ("drafter",), registry=r)
        self._drafted: dict[str, list[float]] = {}  # drafter -> [seconds, tokens]
        self._step = 0.0  # target_step_seconds' value

    def request(self, draft: str, version: str | None, domain: str, stats, figures: dict, max_tokens: int | None = None) -> None:
        """Count one finished request (``figures``: :func:`onlinespec.metrics.speculative_decoding`;
        ``max_tokens``: its token budget), in both families."""
        labels = (draft, version or "none", domain)
        self._retire_old_versions(draft, labels, len(figures["num_accepted_tokens_per_pos"]))
        self.num_drafts.labels(*labels).inc(figures["num_drafts"])
        self.num_draft_tokens.labels(*labels).inc(figures["num_draft_tokens"])
        self.num_accepted_tokens.labels(*labels).inc(figures["num_accepted_tokens"])
        for position, n in enumerate(figures["num_accepted_tokens_per_pos"]):
            self.accepted_per_pos.labels(*labels, str(position)).inc(n)
        self.generation_tokens.labels(*labels).inc(stats.new_tokens)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.requests.labels(stats.finish_reason or "unknown").inc()
        self.latency.observe(stats.seconds)
        self.queue_time.observe(stats.queued_seconds)
        self.ttft.observe(stats.first_token_seconds)
        self._draft_costs(stats.timings[1:])
        self.vllm.request(stats, figures, max_tokens)

    def target_step(self, seconds: float) -> None:
        """One step of the target alone (batch 1, one token), the unit of c."""
        self._step = seconds
        self.target_step_seconds.set(seconds)
        for drafter in self._drafted:
            self._set_cost(drafter)

    def _draft_costs(self, timings) -> None:
        """Count a request's rounds (round 0, the prefill, excluded) into c per drafter."""
        for t in timings:
            if t.proposed and t.drafter:
                seconds = t.draft_seconds / max(t.batch, 1)
                totals = self._drafted.setdefault(t.drafter, [0.0, 0])
                totals[0] += seconds
                totals[1] += t.proposed
                self.draft_seconds.labels(t.drafter).inc(seconds)
                self.drafted_tokens.labels(t.drafter).inc(t.proposed)
                self._set_cost(t.drafter)

    def _set_cost(self, drafter: str) -> None:
        seconds, tokens = self._drafted[drafter]
        if self._step > 0 and tokens:
            self.draft_cost.labels(drafter).set(seconds / tokens / self._step)

    def batch(self, running: int, waiting: int, kv_usage: float | None = None) -> None:
        """The engine's batch now: requests running and waiting, the share of the KV cache in use."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.vllm.batch(running, waiting, kv_usage)

    def scheduler(self, scheduler) -> None:
        """Export the fair scheduler's preemptions and the steps held tenants' rows sat out
        (``onlinespec.decoding.step_shares``), read at each scrape."""
        self.registry.register(_SchedulerCollector(scheduler))

    def prefix_cache(self, cache) -> None:
        """Export the prefix cache's size, budget and evictions, read at each scrape from
        ``cache()`` (a :class:`~onlinespec.decoding.prefix_cache.PrefixCache`, or None: off)."""
        self.registry.register(_PrefixCacheCollector(cache))

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm.itl.labels(self.vllm.model_name).observe(seconds)

    def _retire_old_versions(self, draft: str, labels: tuple, positions: int) -> None:
        """Keep the per-version series of a draft's newest KEEP_VERSIONS versions only: a server
        that learns for weeks publishes thousands (/metrics stays bounded; the totals per draft
        live on in the newer versions' rates, and each version's figures are in the event log)."""
        versions = self._series.setdefault(draft, {})
        versions.setdefault(labels[1], set()).update((*labels, str(p)) for p in range(positions))
        versions[labels[1]].add(labels)
        while len(versions) > KEEP_VERSIONS:
            old = next(iter(versions))
            for series in versions.pop(old):
                counters = (self.accepted_per_pos,) if len(series) == 4 else (
                    self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.generation_tokens)
                for counter in counters:
                    try:
                        counter.remove(*series)
                    except KeyError:  # never made (a request with no proposals)
                        pass

    def serving(self, draft: str, version: str | None) -> None:
        """``draft`` now serves ``version`` (the info gauge keeps one series per draft at 1)."""
        old = self._versions.get(draft)
        if old == (version or "none"):
            return
        if old is not None:
            self.version.remove(draft, old)
        self._versions[draft] = version or "none"
        self.version.labels(draft, version or "none").set(1)

    def routing(self, event: dict, pool) -> None:
        """Count a content-routing event (the pool calls under its lock: its state is steady)."""
        kind = event["event"]
        if kind == "drift":
            self.drift.labels(event["kind"]).inc()
        elif kind == "cluster" and event.get("why") != "first":
            self.drift.labels("new_cluster").inc()
        elif kind == "cluster_returned":
            self.drift.labels("returned").inc()
        elif kind.startswith("draft_") and kind[6:] in ("spawned", "evicted", "reloaded"):
            self.lifecycle.labels(kind[6:]).inc()
        elif kind == "merge" and event.get("retired"):
            self.lifecycle.labels("retired").inc()
        elif kind == "scorer_behind":
            self.unscored.inc(event["dropped"])
        self.clusters.set(sum(k.live for k in pool.content.router.clusters.values()))
        self.in_memory.set(len(pool.drafts))

    def learner(self, event: dict) -> None:
        """Count a learner's event: an update's outcome, a failure, a stopped learner, a version
        another process made current."""
        name, kind = event.get("draft", ""), event["event"]
        if kind == "update":
            self.update(name, event["outcome"], event["seconds"])
            if event["version"]:
                self.serving(name, event["version"])
            self.learner_stopped.labels(name).set(0)  # an update ran to its end: the learner is (again) alive
        elif kind == "update_failed":
            self.update(name, "failed")
        elif kind == "learner_stopped":
            self.learner_stopped.labels(name).set(1)
        elif kind in ("version", "rollback"):  # another process's version is served now
            self.serving(name, event["version"])

    def update(self, draft: str, outcome: str, seconds: float | None = None) -> None:
        self.updates.labels(draft, outcome).inc()
        if seconds is not None:
            self.update_seconds.labels(draft).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def batch_state(scheduler) -> tuple[int, int, float]:
    """(requests running, requests waiting, share of the KV cache in use) of a
    :class:`~onlinespec.decoding.scheduler.Scheduler`: the share is the prompt and generated tokens
    of the requests in the batch over ``max_batch`` x the context (what llama.cpp allocates)."""
    running = list(scheduler.running)
    room = scheduler.max_batch * scheduler.engine.context
    held = sum(len(request.ids) for request in running)
    return len(running), len(scheduler.waiting), min(held / room, 1.0) if room > 0 else 0.0


class _SchedulerCollector:
    """``onlinespec:scheduler_preemptions_total`` and ``onlinespec:held_rows_sat_out_steps_total``."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def describe(self):
        return []

    def collect(self):
        yield CounterMetricFamily(PREFIX + "scheduler_preemptions", "Choices taken out of the batch to give a slot to another tenant",
                                  value=self.scheduler.preempted)
        yield CounterMetricFamily(PREFIX + "held_rows_sat_out_steps", "Steps in which the rows of tenants over their share of the slots "
                                  "sat out, their share of the time spent (--held-decode-share)", value=self.scheduler.decode_share.sat_out)


class _PrefixCacheCollector:
    """``onlinespec:prefix_cache_cells``, ``..._budget_cells`` and ``..._evicted_cells_total``
    (vLLM's prefix-cache queries and hits: :mod:`onlinespec.serve.vllm_metrics`)."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def describe(self):
        return []  # read at scrape time: the cache may not exist when the collector registers

    def collect(self):
        cache = self.cache()
        cells, budget, evicted = (cache.cells, cache.budget, cache.evicted_cells) if cache is not None else (0, 0, 0)
        yield GaugeMetricFamily(PREFIX + "prefix_cache_cells", "KV cells finished requests keep for prefix caching", value=cells)
        yield GaugeMetricFamily(PREFIX + "prefix_cache_budget_cells", "The most cells the prefix cache keeps (--prefix-cache-cells; 0: off)",
                                value=budget)
        yield CounterMetricFamily(PREFIX + "prefix_cache_evicted_cells", "Cached cells evicted, least recently used first, for the budget "
                                  "or a live request", value=evicted)
