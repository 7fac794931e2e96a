"""A serving core that routes by content (no labels): two kinds of prompts get two clusters and
two drafts, every answer is the target's own, the drafts past --max-drafts wait in their
registries and come back with their clusters, and a restart routes as before."""

from __future__ import annotations

import time

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.models import load_model
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learner import LearnerConfig
from onlinespec.routing.content import ContentConfig
from onlinespec.routing.lifecycle import ROUTING_FILE
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
# two kinds of text whose prompt states lie far apart in the tiny target (its weights are random)
KINDS = {"words": lambda i: "the cat " * (6 + i % 5), "digits": lambda i: " ".join(str(d % 10) for d in range(i, i + 14))}


def start(folder, out_dir) -> ServingCore:
    config = CoreConfig(target=str(folder), draft="target-layers:1", k=2, kernels=False, adaptive_k=False, router="content",
                        max_drafts=1, learner=LearnerConfig(update_interval=3, steps_per_update=2, batch_size=4, priority="normal"),
                        content=ContentConfig(min_samples=3, idle_requests=5))
    core = ServingCore(config, out_dir)
    core.load()
    return core


def serve(core, kind: str, n: int, offset: int = 0) -> list:
    return [core.submit(KINDS[kind](offset + i), GREEDY, request_id=f"{kind}-{offset + i}").result()
            for i in range(n)]


def test_content_routing_clusters_serves_losslessly_evicts_reloads_and_restarts(tiny_target_folder, tmp_path):
    target = load_model(str(tiny_target_folder))
    alone = SpeculativeDecoder(target.model, target.tokenizer, None)
    core = start(tiny_target_folder, tmp_path / "run")
    try:
        words = serve(core, "words", 8)
        digits = serve(core, "digits", 12)
        deadline = time.monotonic() + 30  # the words' draft leaves memory once its update ends (--max-drafts 1)
        while not core.routing()["evicted"] and time.monotonic() < deadline:
            time.sleep(0.2)
        back = serve(core, "words", 6, offset=8)
        for served, text in [(s, KINDS["words"](i)) for i, s in enumerate(words + back)] + \
                            [(s, KINDS["digits"](i)) for i, s in enumerate(digits)]:
            assert served.token_ids == alone.generate(text, SamplingParams(max_new_tokens=6)).token_ids
        home = lambda served: served.metrics()["learning_draft"]  # noqa: E731
        assert {home(s) for s in words} == {home(s) for s in back} != {home(s) for s in digits[-4:]}
        assert words[0].metrics()["cluster"] != digits[-1].metrics()["cluster"]
        deadline = time.monotonic() + 30  # a draft still updating leaves memory when its update ends
        while len(core.routing()["in_memory"]) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        routing = core.routing()
        assert routing["lifecycle"]["spawned"] == 2 and routing["detections"]
        assert routing["lifecycle"]["evicted"] >= 1 and routing["lifecycle"]["reloaded"] >= 1  # --max-drafts 1
        assert len(routing["in_memory"]) == 1 and len(routing["evicted"]) == 1
        states = {row["name"]: row["state"] for row in core.drafts()}
        assert any(s.startswith("evicted") for s in states.values()) and "static" in states
        # a purge reaches the records of a draft that is on disk only
        (evicted,) = routing["evicted"]
        served = {s.request_id: s for s in words + back + digits}
        victim = next(rid for rid, s in served.items() if home(s) == evicted)
        assert core.purge(request_id=victim)["records_deleted"] == 1
        left = ReplayBuffer(tmp_path / "run" / "buffer" / evicted, max_records=10**9, max_bytes=2**62).records()
        assert left and victim not in {r.request_id for r in left}
        metrics = core.metrics.text().decode()
        assert "onlinespec:drift_detections_total" in metrics and 'onlinespec:draft_lifecycle_total{action="spawned"} 2.0' in metrics
    finally:
        core.shutdown(drain_seconds=5)
    assert (tmp_path / "run" / ROUTING_FILE).exists()
    core = start(tiny_target_folder, tmp_path / "run")
    try:
        again = serve(core, "words", 2, offset=20)
        assert {s.metrics()["learning_draft"] for s in again} == {home(s) for s in words}  # the same cluster, the same draft
        assert core.routing()["requests"] == 26 + 2
    finally:
        core.shutdown(drain_seconds=5)


def test_a_scorer_that_falls_behind_drops_the_oldest_requests_and_serving_goes_on(tiny_target_folder, tmp_path, monkeypatch):
    """The scorer runs at the lowest priority; on a machine that serving saturates it may fall
    behind for good. Its backlog stays bounded (the oldest go unscored), and operators see it."""
    import threading

    import onlinespec.online.pool as pool_module
    import onlinespec.routing.lifecycle as lifecycle_module

    release = threading.Event()
    real = pool_module.learnable

    class Stuck:  # the scorer's metrics wait until released: a scorer that gets no CPU
        def __init__(self, model):
            self.inner = real(model)

        def metrics(self, *args, **kwargs):
            release.wait(60)
            return self.inner.metrics(*args, **kwargs)

    monkeypatch.setattr(lifecycle_module, "SCORE_BACKLOG", 2)
    monkeypatch.setattr(pool_module, "learnable", lambda model: Stuck(model) if threading.current_thread().name == "onlinespec-scorer" else real(model))
    target = load_model(str(tiny_target_folder))
    alone = SpeculativeDecoder(target.model, target.tokenizer, None)
    core = start(tiny_target_folder, tmp_path / "run")
    try:
        served = serve(core, "words", 8)
        for i, s in enumerate(served):
            assert s.token_ids == alone.generate(KINDS["words"](i), SamplingParams(max_new_tokens=6)).token_ids
        deadline = time.monotonic() + 10  # the recorder queues each request's records after its answer
        while core.routing()["scores_dropped"] < 8 - 2 - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert core.routing()["scores_dropped"] >= 8 - 2 - 1  # all but the backlog and the one being scored
        assert 'onlinespec:routing_requests_unscored_total' in core.metrics.text().decode()
    finally:
        release.set()
        core.shutdown(drain_seconds=5)
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert '"scorer_behind"' in events
