"""The learner under failure and governance: options refused when configured, failed updates
counted until the learner stops (serving goes on), opt-outs never counted, the priority policy
scored, old versions pruned, and a registry of another draft refused instead of half-loaded."""

from __future__ import annotations

import pytest
import torch

from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.distill.step import DistillConfig
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learner import LearnerConfig, OnlineLearner
from onlinespec.online.registry import DraftRegistry

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 32, (6,), generator=gen).tolist() for _ in range(n)]


def make(tiny_llama, tmp_path, policy="window", draft_seed=5, hidden=32, **config):
    target = tiny_llama(seed=0, vocab_size=32, hidden_size=32)
    proposer = DraftModelProposer(tiny_llama(seed=draft_seed, vocab_size=32, hidden_size=hidden))
    learner = OnlineLearner(
        proposer, ReplayBuffer(tmp_path / "buffer", policy=policy), DraftRegistry(tmp_path / "drafts"),
        LearnerConfig(**{"update_interval": 2, "steps_per_update": 2, "batch_size": 4, "position_policy": "verified",
                         "priority": "normal", "gate_margin": 1.0, **config}),
        background=False, identity={"draft": f"tiny-{hidden}", "tokenizer": "vocab32"},
    )
    return SpeculativeDecoder(target, None, proposer, k=3), learner


@pytest.mark.parametrize(("make_config", "says"), [
    (lambda: DistillConfig(loss="bogus"), "unknown distillation loss 'bogus': use one of fkl, rkl, jsd, tvd"),
    (lambda: DistillConfig(beta=1.5), "beta must lie in"),
    (lambda: DistillConfig(temperature=0.0), "temperature must be > 0"),
    (lambda: LearnerConfig(lr=-1e-3), "learning rate must be a positive number"),
    (lambda: LearnerConfig(lr=float("nan")), "learning rate must be a positive number"),
    (lambda: LearnerConfig(gate_fraction=1.0), "gate_fraction"),
    (lambda: LearnerConfig(position_policy="all"), "use one of"),
    (lambda: LearnerConfig(max_failures=0), "max_failures"),
    (lambda: LearnerConfig(shift_scale=0.0), "shift_scale"),
])
def test_bad_options_are_refused_when_configured(make_config, says):
    with pytest.raises(ValueError, match=says):
        make_config()


def test_failed_updates_are_counted_and_the_learner_stops_after_max_failures(tiny_llama, tmp_path):
    decoder, learner = make(tiny_llama, tmp_path, max_failures=2)
    events = []
    learner.on_event = events.append

    def broken(*args):
        raise RuntimeError("injected: the optimizer blew up")

    learner.updater.train = broken
    for prompt in prompts(8):
        out = decoder.generate(prompt, PARAMS, trace=True)
        learner.observe(out)
    assert len(learner.failures) == 2 and "injected" in learner.failures[0]
    assert learner.stopped and "2 updates failed in a row" in learner.stopped and not learner.due
    assert [e["event"] for e in events] == ["update_start", "update_failed", "update_start", "update_failed", "learner_stopped"]
    assert decoder.generate(prompts(1, 7)[0], PARAMS).token_ids  # serving goes on
    del learner.updater.train  # fixed: an operator's update starts it again
    assert learner.update_now() and learner.stopped is None and learner.reports[-1].outcome == "published"


def test_opted_out_requests_are_not_stored_and_do_not_count_towards_the_interval(tiny_llama, tmp_path):
    decoder, learner = make(tiny_llama, tmp_path)
    for prompt in prompts(5):
        assert learner.observe(decoder.generate(prompt, PARAMS), train=False) is False
    assert len(learner.buffer) == 0 and not learner.due and not learner.reports


def test_priority_policy_scores_every_record_after_an_update(tiny_llama, tmp_path):
    decoder, learner = make(tiny_llama, tmp_path, policy="priority")
    for prompt in prompts(2):
        learner.observe(decoder.generate(prompt, PARAMS, trace=True))
    assert learner.reports, "no update ran"
    priorities = [e.priority for e in learner.buffer._entries]
    assert all(p != float("inf") for p in priorities) and len(set(priorities)) == 2  # scored, by the draft's own loss


def test_keep_versions_prunes_all_but_the_newest_the_current_its_parent_and_the_starting_draft(tiny_llama, tmp_path):
    decoder, learner = make(tiny_llama, tmp_path, keep_versions=2)
    for prompt in prompts(10):
        learner.observe(decoder.generate(prompt, PARAMS, trace=True))
    versions = learner.registry.versions()
    assert len(versions) == 3 and versions[-1] == learner.registry.current() and learner.pruned
    assert learner.registry.meta(versions[-1])["parent"] == versions[1]
    assert versions[0] == "v0001" and learner.registry.meta("v0001")["parent"] is None  # the floor's fallback is kept


def test_a_registry_of_another_draft_is_refused_not_loaded_partially(tiny_llama, tmp_path):
    decoder, learner = make(tiny_llama, tmp_path)
    for prompt in prompts(2):
        learner.observe(decoder.generate(prompt, PARAMS, trace=True))
    with pytest.raises(ValueError, match="trained for another model.*draft: the registry's is 'tiny-32', this run's is 'tiny-16'"):
        make(tiny_llama, tmp_path, hidden=16)
    registry = DraftRegistry(tmp_path / "drafts")  # without identities (an older registry): the weights must still fit
    meta = registry.meta(registry.current())
    meta.pop("identity")
    (registry.directory / registry.current() / "meta.json").write_text(__import__("json").dumps(meta))
    with pytest.raises(ValueError, match="do not fit this draft"):
        make(tiny_llama, tmp_path, hidden=16)


def test_the_update_steps_train_gate_and_publish_each_on_their_own(tiny_llama, tmp_path):
    decoder, learner = make(tiny_llama, tmp_path, update_interval=100, steps_per_update=3)
    for prompt in prompts(4):
        learner.observe(decoder.generate(prompt, PARAMS, trace=True))
    records = learner.buffer.records()
    serving, parent = learner.publisher.latest
    candidate, optimizer, examples, plan = learner.updater.train(serving, records)
    # a first update is a shifted one (onlinespec.online.schedule): twice the steps
    assert candidate is not serving and examples == len(records) and learner.steps_done == plan.steps == 6
    before, after, by_domain, passed = learner.updater.gate.judge(serving, candidate, {"default": records[-1:]}, learner.updater.gate.figure(False))
    assert set(before) >= {"loss", "alpha"} and by_domain == {} and passed  # gate margin 1: any candidate passes
    learner.registry.publish(serving.state_dict(), {"parent": parent, "note": "another process"})  # CURRENT moved meanwhile
    assert learner.publisher.publish(candidate, {"parent": parent}, parent) is None  # its choice stands
    assert learner.follow_registry() == learner.registry.current() == "v0002" and learner.publisher.current == "v0002"
    assert learner.publisher.publish(candidate, {"parent": "v0002"}, "v0002") == "v0003"
