"""Online learning of a feature head: records carry the target's features from verification, the
learner trains chains on them in the background, and the output stays exactly the target's."""

import torch

from onlinespec.decoding.autoregressive import autoregressive_decoder
from onlinespec.decoding.feature_head import FeatureHead
from onlinespec.decoding.proposers.feature import FeatureHeadProposer
from onlinespec.decoding.proposers.hybrid import HybridProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.distill.step import DistillConfig
from onlinespec.drafts.train import chain_task, records_to_signal
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learner import LearnerConfig, OnlineLearner
from onlinespec.online.recorder import record_from_generation
from onlinespec.online.registry import DraftRegistry

PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (6,), generator=gen).tolist() for _ in range(n)]


def make(tiny_llama):
    target = tiny_llama(seed=0, vocab_size=32, hidden_size=32)
    torch.manual_seed(1)
    head = FeatureHead.for_target(target, torch.arange(24), intermediate_size=32, num_blocks=1)
    return target, head


def test_records_hold_consecutive_features_that_match_the_target(tiny_llama, tmp_path, one_thread):
    target, head = make(tiny_llama)
    decoder = SpeculativeDecoder(target, None, FeatureHeadProposer(head), k=3)
    out = decoder.generate(prompts(1)[0], PARAMS, trace=True)
    record = record_from_generation(out, "rejected")
    # every verified row is kept for a head, whatever the policy; rejection rows are flagged
    assert record.positions == list(range(6, 6 + 20))
    assert sum(record.rejected) == out.stats.rejected
    with torch.inference_mode():
        full = target.get_decoder()(input_ids=torch.tensor([out.prompt_ids + out.token_ids])).last_hidden_state[0]
    assert torch.allclose(record.features.float(), full[5:25], atol=1e-2)
    # the buffer round-trips features and flags
    buffer = ReplayBuffer(tmp_path / "b", policy="window")
    buffer.add(record)
    again = ReplayBuffer(tmp_path / "b", policy="window").records()[0]
    assert torch.equal(again.features, record.features) and again.rejected == record.rejected
    signal, rejected = records_to_signal([record])
    assert signal.ids.tolist() == (out.prompt_ids + out.token_ids)[5:25]
    assert chain_task([record], "rejected").starts.numel() == int(rejected[1:].sum())


def test_online_head_learning_raises_acceptance_and_keeps_output_exact(tiny_llama, tmp_path, one_thread):
    target, head = make(tiny_llama)
    proposer = HybridProposer(FeatureHeadProposer(head), min_ngram=3)
    learner = OnlineLearner(
        proposer, ReplayBuffer(tmp_path / "buffer", policy="window"), DraftRegistry(tmp_path / "drafts"),
        LearnerConfig(update_interval=8, steps_per_update=60, batch_size=64, lr=3e-3, position_policy="verified", priority="normal",
                      distill=DistillConfig(loss="fkl")),
        background=False,  # updates between requests, so the curve does not depend on the machine's speed
    )
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    reference = autoregressive_decoder(target)
    alphas, versions = [], []
    for prompt in prompts(56):
        out = decoder.generate(prompt, PARAMS, trace=True)
        assert out.token_ids == reference.generate(prompt, PARAMS).token_ids
        alphas.append(out.stats.acceptance_rate)
        versions.append(proposer.version)
        learner.observe(out, domain="test")
    learner.wait()
    published = [r for r in learner.reports if r.version]
    assert published and len(set(versions)) > 1
    # the gate judged each candidate by what the hybrid serving with it accepts, replayed on the held-out records
    assert all(r.gate_metric == "replayed" and r.replayed_after >= r.replayed_before for r in published)
    assert sum(alphas[-12:]) / 12 > sum(alphas[:12]) / 12 + 0.1, (alphas[:12], alphas[-12:])
    # a published version loads back into a head
    state = learner.registry.load(published[-1].version)
    restored = head.clone()
    restored.load_state_dict(state)
    assert torch.equal(restored.fuse.weight, proposer.model.fuse.weight) or proposer.version != published[-1].version


def test_a_restart_serves_the_registrys_current_version(tiny_llama, tmp_path, one_thread):
    target, head = make(tiny_llama)
    registry = DraftRegistry(tmp_path / "drafts")
    trained = head.clone()
    with torch.no_grad():
        trained.fuse.weight.add_(0.5)
    registry.publish(head.state_dict(), {"parent": None, "note": "starting draft"})
    version = registry.publish(trained.state_dict(), {"parent": "v0001"})
    # a fresh process: the starting head again, the same registry and buffer folders
    proposer = FeatureHeadProposer(head)
    OnlineLearner(proposer, ReplayBuffer(tmp_path / "buffer", policy="window"), registry, LearnerConfig())
    assert proposer.version == version
    assert torch.equal(proposer.model.fuse.weight, trained.fuse.weight)
    assert not torch.equal(head.fuse.weight, trained.fuse.weight)  # the starting head was not overwritten
