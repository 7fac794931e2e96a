"""Sampled output stays the target's distribution while the draft learns between engine steps.

A serving core on the tiny random target, its draft a learning draft LM (the target's first layer),
an update every 3 requests, the learner computing in the engine's turns (``learn_share`` 1.0: a
turn after every step it asks for one), so optimizer steps, gate evaluations and hot swaps of the
draft fall between the steps of requests in flight. N = 400 requests of 3 sampled tokens
(temperature 1, top-k 3: 27 possible continuations), 8 in flight, seeds 0..399; the continuations
against the target alone's exact distribution, chi-square (bins of expected count < 5 pooled),
p > 1e-3 (``PASS_P``); a continuation the target rules out must never appear.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.models import load_model
from onlinespec.online.learner import LearnerConfig
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore
from tests.decoding.test_lossless_engine import PASS_P, exact_distribution, fit

N, NEW_TOKENS = 400, 3
PROMPT = [17, 404, 1121, 28]  # token ids: what the core serves is exactly what the exact distribution conditions on
SAMPLING = dict(temperature=1.0, top_k=3)


def test_sampling_follows_the_target_while_learning_runs_between_steps(tiny_target_folder, tmp_path, chi_square):
    torch.set_num_threads(1)
    learner = LearnerConfig(update_interval=3, steps_per_update=3, batch_size=4, gate_margin=1.0)  # every candidate published
    config = CoreConfig(target=str(tiny_target_folder), draft="target-layers:1", k=2, kernels=False, adaptive_k=False,
                        max_batch=8, max_waiting=N, learner=learner, learn_share=1.0)
    core = ServingCore(config, tmp_path / "run")
    core.load()
    try:
        def sample(seed: int):
            params = SamplingParams(max_new_tokens=NEW_TOKENS, seed=seed, ignore_eos=True, **SAMPLING)
            served = core.submit(PROMPT, params, domain="d").result()
            return tuple(served.token_ids), served.draft_version

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(sample, range(N)))
        learning = core.learning()
    finally:
        core.shutdown(drain_seconds=5)
    versions = {version for _, version in results}
    assert len(versions) >= 5, versions  # the draft was swapped many times while requests ran
    assert learning["engine_seconds"] > 0 and learning["turns"] > 0, learning  # learning ran in the engine's turns
    target = load_model(str(tiny_target_folder)).model
    exact = exact_distribution(target, PROMPT, SamplingParams(**SAMPLING), NEW_TOKENS)
    counts: dict[tuple, int] = {}
    for tokens, _ in results:
        assert len(tokens) == NEW_TOKENS
        counts[tokens] = counts.get(tokens, 0) + 1
    assert sum(c for x, c in counts.items() if exact.get(x, 0.0) == 0) == 0, "emitted a continuation the target rules out"
    p_value, stat, df = fit(counts, exact, chi_square)
    assert p_value > PASS_P, (p_value, stat, df)
