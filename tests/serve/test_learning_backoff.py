"""A draft whose updates stopped earning (onlinespec.online.controller) also records less: one
request in ``backoff`` is traced and stored, every one still counts towards the update interval
and feeds the suffix index, and every answer is the target's own."""

from __future__ import annotations

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.online.learner import LearnerConfig
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore


def test_a_backed_off_draft_records_one_request_in_backoff_and_still_counts_every_one(tiny_target_folder, tmp_path, alone):
    config = CoreConfig(target=str(tiny_target_folder), draft="hybrid:fresh", k=2, kernels=False, adaptive_k=False,
                        learner=LearnerConfig(update_interval=100, steps_per_update=2, batch_size=4, priority="normal"))
    core = ServingCore(config, tmp_path / "run")
    core.load()
    try:
        params = SamplingParams(temperature=0.0)
        prompts = [f"def f{i}(x):" for i in range(12)]
        first = [core.submit(p, params, domain="code", max_tokens=6).result() for p in prompts[:4]]
        draft = core.pool.drafts["code"]
        assert [s.recorded for s in first] == [True] * 4 and draft.learner.governance()["held"] == 4

        draft.learner.backoff = 4  # the controller's decision after updates that earned nothing
        indexed = draft.suffix.tokens
        later = [core.submit(p, params, domain="code", max_tokens=6).result() for p in prompts[4:]]
        assert sum(s.recorded for s in later) == 2  # 8 requests, one in 4 recorded
        assert draft.learner.governance()["held"] == 6
        assert draft.learner._count == 12  # every request counts towards the (backed-off) interval
        assert draft.suffix.tokens - indexed == sum(len(s.prompt_ids) + len(s.token_ids) for s in later)  # unrecorded ones too
        for prompt, served in zip(prompts, first + later):
            assert served.token_ids == alone.generate(prompt, SamplingParams(max_new_tokens=6)).token_ids
    finally:
        core.shutdown(drain_seconds=5)
