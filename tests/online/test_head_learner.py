"""Online learning of a feature head: records carry the target's features from verification, the
learner trains chains on them in the background, and the output stays exactly the target's."""

import pytest
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


@pytest.fixture(scope="module")
def learned(tiny_llama, tmp_path_factory):
    """A head learnt online over 56 requests: (target, starting head, proposer, learner, per request:
    acceptance, the version served, whether the output was the target's)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _learn(tiny_llama, tmp_path_factory.mktemp("learned-head"))
    finally:
        torch.set_num_threads(threads)


def _learn(tiny_llama, folder):
    target, head = make(tiny_llama)
    proposer = HybridProposer(FeatureHeadProposer(head), min_ngram=3)
    learner = OnlineLearner(
        proposer, ReplayBuffer(folder / "buffer", policy="window"), DraftRegistry(folder / "drafts"),
        LearnerConfig(update_interval=8, steps_per_update=60, batch_size=64, lr=3e-3, position_policy="verified", priority="normal",
                      distill=DistillConfig(loss="fkl")),
        background=False,  # updates between requests, so the curve does not depend on the machine's speed
    )
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    reference = autoregressive_decoder(target)
    alphas, versions, identical = [], [], []
    for prompt in prompts(56):
        out = decoder.generate(prompt, PARAMS, trace=True)
        identical.append(out.token_ids == reference.generate(prompt, PARAMS).token_ids)
        alphas.append(out.stats.acceptance_rate)
        versions.append(proposer.version)
        learner.observe(out, domain="test")
    learner.wait()
    return target, head, proposer, learner, alphas, versions, identical


def test_online_head_learning_raises_acceptance_and_keeps_output_exact(learned):
    _, head, proposer, learner, alphas, versions, identical = learned
    assert all(identical)
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


def test_a_draft_that_serves_below_its_starting_draft_falls_back_to_it(learned, tmp_path, one_thread):
    # the starting draft is the learnt head; a worse one (the untrained head) is then published and served
    target, untrained, learnt_proposer, _, _, _, _ = learned
    proposer = HybridProposer(FeatureHeadProposer(learnt_proposer.model.clone()), min_ngram=3)
    events = []
    learner = OnlineLearner(
        proposer, ReplayBuffer(tmp_path / "buffer", policy="window"), DraftRegistry(tmp_path / "drafts"),
        LearnerConfig(update_interval=8, steps_per_update=2, batch_size=64, position_policy="verified", priority="normal",
                      gate_by="newest", gate_fraction=0.5), background=False, on_event=events.append)
    worse = learner.registry.publish(untrained.state_dict(), {"parent": "v0001", "note": "a worse version"})
    learner.serve_version(worse)
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    reference = autoregressive_decoder(target)
    served = []
    for prompt in prompts(16, seed=1):
        out = decoder.generate(prompt, PARAMS, trace=True)
        served.append(proposer.version)  # the version this request was served with (a swap is taken between rounds)
        assert out.token_ids == reference.generate(prompt, PARAMS).token_ids
        learner.observe(out, domain="test")
    # the first update found the served draft below the starting one on the same held-out records (paired, 95%)
    first = learner.reports[0]
    assert first.outcome == "floor" and first.floor_breached and first.static_replayed > first.replayed_before
    floor = next(e for e in events if e["event"] == "floor")
    assert floor["was"] == worse and floor["serves"] == "v0001"
    # the starting draft serves from the next request on, and the registry says so (a restart serves it too)
    assert served[:8] == [worse] * 8 and served[8:] == ["v0001"] * 8
    assert learner.reports[1].parent == "v0001"
    # the next update judged its candidate against the starting draft serving: no floor left to breach
    assert not learner.reports[1].floor_breached and learner.reports[1].outcome in ("published", "refused")
    assert learner.registry.current() == (learner.reports[1].version or "v0001")  # a restart serves what served


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
    learner = OnlineLearner(proposer, ReplayBuffer(tmp_path / "buffer", policy="window"), registry, LearnerConfig())
    assert proposer.version == version
    assert torch.equal(proposer.model.fuse.weight, trained.fuse.weight)
    assert not torch.equal(head.fuse.weight, trained.fuse.weight)  # the starting head was not overwritten
    # it learnt online before: a restart's updates are steady ones, not a new draft's larger steps
    assert learner.updater.trainer.schedule.plan(cold=False).phase == "steady"


def test_a_drafts_first_updates_take_larger_steps_and_a_drift_makes_them_large_again(learned, one_thread):
    # LearnerConfig's defaults: the first shift_updates updates at shift_scale times the rate and the steps
    target, _, proposer, learner, _, _, _ = learned
    config = learner.config
    assert config.shift_updates == 3 and config.shift_scale == 2.0
    phases = [(r.phase, r.lr, r.steps) for r in learner.reports]
    assert phases[:3] == [("shifted", 2 * config.lr, 2 * config.steps_per_update)] * 3
    assert set(phases[3:]) == {("steady", config.lr, config.steps_per_update)}
    # a drift the router detects (hurry) makes the next update due at once, and a shifted one again
    learner.hurry()
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    before = len(learner.reports)
    learner.observe(decoder.generate(prompts(1, seed=2)[0], PARAMS, trace=True), domain="test")
    learner.wait()
    assert len(learner.reports) == before + 1
    assert (learner.reports[-1].phase, learner.reports[-1].lr) == ("shifted", 2 * config.lr)
