"""vLLM's own Prometheus series (``vllm:`` prefix, a ``model_name`` label), beside ours, so that
vLLM's Grafana dashboard and alerts read a server of ours unchanged.

Names, label names and histogram buckets are vLLM's (``vllm/v1/metrics/loggers.py``). What each
measures here is in its help text and in docs/serve.md ("For vLLM users"). They are fed by the
same calls as our ``onlinespec:`` series (:class:`onlinespec.serve.metrics.ServeMetrics`): one
recording point per event, two families. Every label value is bounded: the served model name,
a finish reason (``stop``, ``length``) and a draft position (< k).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

VLLM = "vllm:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                   960.0, 1920.0, 7680.0)
MAX_TOKEN_BUCKET = 1_000_000  # vLLM's 1-2-5 token-count buckets end at max_model_len; ours at a fixed bound


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's ``build_1_2_5_buckets``)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class VllmMetrics:
    """vLLM's series in ``registry``, every one labelled ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, m, self.model_name = registry, ("model_name",), model_name
        name = lambda n: VLLM + n  # noqa: E731
        hist = lambda n, doc, buckets: Histogram(name(n), doc, m, buckets=buckets, registry=r)  # noqa: E731
        self.running = Gauge(name("num_requests_running"), "Requests in the engine's batch", m, registry=r)
        self.waiting = Gauge(name("num_requests_waiting"), "Requests waiting for a batch slot", m, registry=r)
        kv = ("Share of the KV cache in use, 0..1: prompt and generated tokens of the requests in the batch over "
              "max-num-seqs x the context (the room the llama.cpp backend allocates; torch grows its cache as needed)")
        self.kv_usage = Gauge(name("kv_cache_usage_perc"), kv, m, registry=r)
        self.gpu_kv_usage = Gauge(name("gpu_cache_usage_perc"), kv + " (vLLM's older name, on a CPU too)", m, registry=r)
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter(name("generation_tokens"), "Generated tokens of finished requests", m, registry=r)
        self.success = Counter(name("request_success"), "Finished requests by finish reason", (*m, "finished_reason"), registry=r)
        self.e2e = hist("e2e_request_latency_seconds", "From arrival to the last token", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "From arrival to joining the batch", REQUEST_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "From joining the batch to the last token", REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "From joining the batch to the first token", REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "From the first token to the last", REQUEST_BUCKETS)
        self.ttft = hist("time_to_first_token_seconds", "From arrival to the first token", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Per request: (e2e - ttft) / (generated tokens - 1)", TPOT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Between tokens (a verified round's tokens share its wait)", TPOT_BUCKETS)
        counts = one_two_five(MAX_TOKEN_BUCKET)
        self.request_prompt = hist("request_prompt_tokens", "Prompt tokens per finished request", counts)
        self.request_generation = hist("request_generation_tokens", "Generated tokens per finished request", counts)
        self.max_tokens = hist("request_params_max_tokens", "The request's token budget (max_tokens, or what the context left)", counts)
        self.max_generation = hist("request_max_num_generation_tokens", "The request's token budget (one sequence per request)", counts)
        self.prefix_queries = Counter(name("prefix_cache_queries"), "Prompt tokens looked up in the prefix cache (llama.cpp, "
                                      "--enable-prefix-caching)", m, registry=r)
        self.prefix_hits = Counter(name("prefix_cache_hits"), "Prompt tokens whose KV cells came from the prefix cache", m, registry=r)
        self.drafts = Counter(name("spec_decode_num_drafts"), "Rounds that sent proposals", m, registry=r)
        self.draft_tokens = Counter(name("spec_decode_num_draft_tokens"), "Proposed tokens", m, registry=r)
        self.accepted = Counter(name("spec_decode_num_accepted_tokens"), "Accepted proposals", m, registry=r)
        self.accepted_per_pos = Counter(name("spec_decode_num_accepted_tokens_per_pos"), "Accepted proposals by position in the draft",
                                        (*m, "position"), registry=r)
        for gauge in (self.running, self.waiting, self.kv_usage, self.gpu_kv_usage):
            gauge.labels(model_name).set(0)  # present from the start: a dashboard shows 0, not "no data"
        for counter in (self.prefix_queries, self.prefix_hits):
            counter.labels(model_name)  # 0 from the start (the cache off, or on torch: it stays 0)

    def request(self, stats, figures: dict, max_tokens: int | None) -> None:
        """One finished request (``stats``: its RequestStats; ``figures``: onlinespec.metrics.speculative_decoding)."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(stats.prompt_tokens)
        self.generation_tokens.labels(name).inc(stats.new_tokens)
        self.success.labels(name, stats.finish_reason or "unknown").inc()
        self.e2e.labels(name).observe(stats.seconds)
        self.queue.labels(name).observe(stats.queued_seconds)
        self.inference.labels(name).observe(max(stats.seconds - stats.queued_seconds, 0.0))
        self.prefill.labels(name).observe(max(stats.first_token_seconds - stats.queued_seconds, 0.0))
        self.decode.labels(name).observe(max(stats.seconds - stats.first_token_seconds, 0.0))
        self.ttft.labels(name).observe(stats.first_token_seconds)
        if stats.new_tokens > 1:
            self.tpot.labels(name).observe(max(stats.seconds - stats.first_token_seconds, 0.0) / (stats.new_tokens - 1))
        self.request_prompt.labels(name).observe(stats.prompt_tokens)
        if stats.prefix_queried:
            self.prefix_queries.labels(name).inc(stats.prefix_queried)
            self.prefix_hits.labels(name).inc(stats.cached_tokens)
        self.request_generation.labels(name).observe(stats.new_tokens)
        if max_tokens is not None:
            self.max_tokens.labels(name).observe(max_tokens)
            self.max_generation.labels(name).observe(max_tokens)
        self.drafts.labels(name).inc(figures["num_drafts"])
        self.draft_tokens.labels(name).inc(figures["num_draft_tokens"])
        self.accepted.labels(name).inc(figures["num_accepted_tokens"])
        for position, n in enumerate(figures["num_accepted_tokens_per_pos"]):
            self.accepted_per_pos.labels(name, str(position)).inc(n)

    def batch(self, running: int, waiting: int, kv_usage: float | None) -> None:
        self.running.labels(self.model_name).set(running)
        self.waiting.labels(self.model_name).set(waiting)
        if kv_usage is not None:
            self.kv_usage.labels(self.model_name).set(kv_usage)
            self.gpu_kv_usage.labels(self.model_name).set(kv_usage)
