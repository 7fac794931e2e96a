"""A draft whose updates stopped earning (onlinespec.online.controller) also records less: one
request in ``backoff`` is traced and stored, every one still counts towards the update interval
and feeds the suffix index, and every answer is the target's own. Recording also follows the
headroom (the share of the engine's time at loads where a draft could pay at all)."""

from __future__ import annotations

import pytest

from onlinespec.decoding.adaptive import AdaptiveK
from onlinespec.decoding.cost_curve import CostCurve
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.online.learner import LearnerConfig
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore
from onlinespec.serve.learning import LearningShare
from onlinespec.serve.metrics import ServeMetrics


def test_a_backed_off_draft_records_one_request_in_backoff_and_still_counts_every_one(tiny_target_folder, tmp_path, alone):
    config = CoreConfig(target=str(tiny_target_folder), draft="hybrid:fresh", k=2, kernels=False, adaptive_k=False,
                        learner=LearnerConfig(update_interval=100, steps_per_update=2, batch_size=4, priority="normal"))
    core = ServingCore(config, tmp_path / "run")
    core.load()
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=6)
        prompts = [f"def f{i}(x):" for i in range(12)]
        first = [core.submit(p, params, domain="code").result() for p in prompts[:4]]
        draft = core.pool.drafts["code"]
        assert [s.recorded for s in first] == [True] * 4 and draft.learner.governance()["held"] == 4

        draft.learner.backoff = 4  # the controller's decision after updates that earned nothing
        indexed = draft.suffix.tokens
        later = [core.submit(p, params, domain="code").result() for p in prompts[4:]]
        assert sum(s.recorded for s in later) == 2  # 8 requests, one in 4 recorded
        assert draft.learner.governance()["held"] == 6
        assert draft.learner._count == 12  # every request counts towards the (backed-off) interval
        assert draft.suffix.tokens - indexed == sum(len(s.prompt_ids) + len(s.token_ids) for s in later)  # unrecorded ones too
        draft.learner.backoff = 1  # and at a load where a draft could pay only half the time, half of them
        assert sum(draft.learner.records_next(0.5) for _ in range(8)) == 4
        assert not any(draft.learner.records_next(0.0) for _ in range(8))  # none where no draft can pay
        for prompt, served in zip(prompts, first + later):
            assert served.token_ids == alone.generate(prompt, SamplingParams(max_new_tokens=6)).token_ids
    finally:
        core.shutdown(drain_seconds=5)


def test_learning_and_recording_under_load_follow_the_headroom():
    """Steps at a batch where no draft could pay (a compute-bound batch of the measured curve) leave
    learning no share and recording nothing; prompt-chunk steps (batch 0) do not count against it."""
    curve = CostCurve({(1, 64): [1.0, 1.3, 1.6, 1.9, 2.2], (8, 64): [2.0, 3.66, 5.3, 7.0, 8.6]})
    metrics = ServeMetrics()
    share = LearningShare(0.1, metrics, dict, lambda event: None, lambda: None, AdaptiveK(curve), 4)
    for batch in (0, 1, 8, 8):
        share.stepped(0.05, batch)
    assert share.turns.headroom() == pytest.approx(0.5, abs=0.01)
    assert metrics.registry.get_sample_value("onlinespec:learn_headroom") == pytest.approx(0.5, abs=0.01)
    assert share.state()["headroom"] == pytest.approx(0.5, abs=0.01)
