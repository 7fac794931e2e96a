"""The online learner: updates in the background every I requests, publishes gated versions,
and the serving output stays exactly the target's throughout."""

import torch

from onlinespec.decoding.autoregressive import autoregressive_decoder
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.distill.step import DistillConfig
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learner import LearnerConfig, OnlineLearner
from onlinespec.online.registry import DraftRegistry

PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


def setup(tiny_llama, tmp_path, background=True, **config):
    target = tiny_llama(seed=0, vocab_size=32, hidden_size=32)
    draft = tiny_llama(seed=5, vocab_size=32, hidden_size=32)
    proposer = DraftModelProposer(draft)
    learner = OnlineLearner(
        proposer, ReplayBuffer(tmp_path / "buffer", policy="window"), DraftRegistry(tmp_path / "drafts"),
        LearnerConfig(**{"update_interval": 8, "steps_per_update": 40, "batch_size": 8, "lr": 3e-3, "position_policy": "verified",
                         "priority": "normal",
                         "distill": DistillConfig(loss="fkl"), **config}),
        background=background,
    )
    return target, draft, proposer, learner


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (6,), generator=gen).tolist() for _ in range(n)]


def test_learning_online_raises_acceptance_and_keeps_output_exact(tiny_llama, tmp_path):
    target, draft, proposer, learner = setup(tiny_llama, tmp_path)
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    reference = autoregressive_decoder(target)
    alphas, versions = [], []
    for prompt in prompts(48):
        out = decoder.generate(prompt, PARAMS, trace=True)
        assert out.token_ids == reference.generate(prompt, PARAMS).token_ids
        alphas.append(out.stats.acceptance_rate)
        versions.append(proposer.version)
        learner.observe(out, domain="test")
    learner.wait()
    published = [r for r in learner.reports if r.version]
    assert published, learner.reports
    assert all(r.alpha_after >= r.alpha_before for r in published)
    registry = learner.registry
    decoder.generate(prompts(1, seed=9)[0], PARAMS)  # the last hand-over is taken at the next round
    assert registry.current() == proposer.version == published[-1].version
    meta = registry.meta(published[-1].version)
    assert meta["parent"] and meta["records_seen"] > 0 and meta["alpha_after"] >= meta["alpha_before"]
    assert len(set(versions)) > 1  # new drafts were swapped in while serving
    assert sum(alphas[-12:]) / 12 > sum(alphas[:12]) / 12 + 0.1
    assert draft.model.layers[0].mlp.up_proj.weight.requires_grad is False  # the starting draft was never trained in place


def test_gate_refuses_a_worse_candidate(tiny_llama, tmp_path):
    target, draft, proposer, learner = setup(tiny_llama, tmp_path, background=False, lr=5.0, steps_per_update=5)
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    first = learner.registry.current()
    for prompt in prompts(8):
        learner.observe(decoder.generate(prompt, PARAMS, trace=True))
    (report,) = learner.reports
    assert report.version is None and report.alpha_after < report.alpha_before
    assert learner.registry.versions() == [first] and proposer.version == first and proposer.model is draft


def test_requests_marked_train_false_are_never_stored(tiny_llama, tmp_path):
    target, _, proposer, learner = setup(tiny_llama, tmp_path, background=False)
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    for prompt in prompts(5):
        learner.observe(decoder.generate(prompt, PARAMS, trace=True), train=False)
    assert len(learner.buffer) == 0
