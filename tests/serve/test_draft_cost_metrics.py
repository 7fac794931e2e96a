"""c, the cost model's draft cost (draft seconds per drafted token over one step of the target
alone), per drafter on /metrics: what an operator reads to see whether a draft is cheap enough
to pay (docs/cpu-speculation.md)."""

from prometheus_client.parser import text_string_to_metric_families

from onlinespec.decoding.request import RequestStats, RoundTiming
from onlinespec.serve.metrics import ServeMetrics


def samples(metrics: ServeMetrics, name: str) -> dict:
    return {s.labels.get("drafter"): s.value for f in text_string_to_metric_families(metrics.text().decode())
            for s in f.samples if s.name == name}


def test_draft_cost_per_drafter_is_seconds_per_drafted_token_over_a_target_step():
    metrics = ServeMetrics()
    timings = [RoundTiming(0, 0.0, 0.050, 1, ""),  # round 0: the prefill, never counted
               RoundTiming(4, 0.004, 0.030, 1, "head"),  # 1 ms per drafted token
               RoundTiming(2, 0.002, 0.030, 2, "head"),  # a batch of 2 shares the call: 0.5 ms per token
               RoundTiming(3, 0.0003, 0.030, 1, "ngram"),  # 0.1 ms per token
               RoundTiming(0, 0.0, 0.010, 1, "")]  # nothing proposed
    stats = RequestStats(new_tokens=9, prompt_tokens=3, finish_reason="length", seconds=0.2, queued_seconds=0.0,
                            first_token_seconds=0.05, timings=timings)
    figures = {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 6, "num_accepted_tokens_per_pos": [3, 2, 1]}
    metrics.request("d", "v0001", "code", stats, figures)
    assert samples(metrics, "onlinespec:drafted_tokens_total") == {"head": 6, "ngram": 3}
    assert samples(metrics, "onlinespec:draft_cost_ratio") == {}  # no target step measured yet: no c
    metrics.target_step(0.010)
    cost = samples(metrics, "onlinespec:draft_cost_ratio")
    assert abs(cost["head"] - (0.004 + 0.001) / 6 / 0.010) < 1e-9
    assert abs(cost["ngram"] - 0.0003 / 3 / 0.010) < 1e-9
