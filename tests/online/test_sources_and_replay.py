"""The online sampling mode is honoured (teacher rows, the draft's rejected branches, or both),
and replaying speculative decoding over the target's greedy answers gives exactly what a live
fixed-k run accepts."""

import pytest
import torch

from onlinespec.data import Query
from onlinespec.decoding.feature_head import FeatureHead
from onlinespec.decoding.proposers.feature import FeatureHeadProposer
from onlinespec.decoding.proposers.hybrid import HybridProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.distill.signal import SignalConfig, build_signal
from onlinespec.distill.step import DistillConfig
from onlinespec.drafts.train import HYBRID_REPLAY, ChainConfig, ChainTask, chain_task, records_replay, replay_acceptance
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learner import LearnerConfig, OnlineLearner
from onlinespec.online.recorder import records_from_generation, student_records
from onlinespec.online.registry import DraftRegistry

PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def make(tiny_llama, seed=0):
    target = tiny_llama(seed=seed, vocab_size=32, hidden_size=32)
    torch.manual_seed(1)
    head = FeatureHead.for_target(target, torch.arange(24), intermediate_size=32, num_blocks=1)
    return target, head


def traced(target, head, k=3, prompt=(3, 1, 4, 1, 5, 9)):
    return SpeculativeDecoder(target, None, FeatureHeadProposer(head), k=k).generate(list(prompt), PARAMS, trace=True)


def test_student_records_are_the_rows_after_each_rejection_in_the_drafts_context(tiny_llama, one_thread):
    target, head = make(tiny_llama)
    out = traced(target, head)
    served = out.prompt_ids + out.token_ids
    branches = student_records(out)
    rejecting = [r for r in out.trace if r.n_accepted < len(r.proposals)]
    assert rejecting and len(branches) == len(rejecting)
    with torch.inference_mode():
        for record, round_ in zip(branches, rejecting):
            n, m = round_.n_accepted, len(round_.proposals)
            # the context is the served text up to the round, then the DRAFT's proposals (the rejected one included)
            assert record.token_ids == served[: round_.position] + round_.proposals
            assert record.positions == [round_.position + j for j in range(n + 1, m + 1)]
            assert record.rejected == [True] * (m - n)
            # each row is the target's own distribution in that context: check against a plain forward
            logits = target(input_ids=torch.tensor([record.token_ids])).logits[0]
            for row, t in enumerate(record.positions):
                expected = torch.log_softmax(logits[t - 1], -1).topk(record.top_ids.shape[1])
                assert record.top_ids[row].tolist() == expected.indices.tolist()
                assert torch.allclose(record.top_logprobs[row], expected.values, atol=1e-4)
            hidden = target.get_decoder()(input_ids=torch.tensor([record.token_ids])).last_hidden_state[0]
            assert torch.allclose(record.features.float(), hidden[[t - 1 for t in record.positions]], atol=1e-2)
    # a head learns on them: every branch row may start a chain under either position policy
    assert chain_task(branches, "rejected").starts.numel() == chain_task(branches, "verified").starts.numel() > 0


def test_each_sampling_mode_yields_its_own_records(tiny_llama, one_thread):
    target, head = make(tiny_llama)
    out = traced(target, head)
    teacher = records_from_generation(out, "verified", "teacher")
    student = records_from_generation(out, "verified", "student")
    mixed = records_from_generation(out, "verified", "mixed")
    assert len(teacher) == 1 and teacher[0].token_ids == out.prompt_ids + out.token_ids
    assert student and all("#student@" in r.request_id for r in student)
    assert len(mixed) == len(teacher) + len(student)
    with pytest.raises(ValueError, match="sampling mode"):
        records_from_generation(out, "verified", "teachers")


def test_the_learner_stores_what_its_sampling_mode_says(tiny_llama, tmp_path, one_thread):
    target, head = make(tiny_llama)
    for sampling in ("teacher", "student", "mixed"):
        proposer = FeatureHeadProposer(head.clone())
        buffer = ReplayBuffer(tmp_path / sampling / "buffer", policy="window")
        learner = OnlineLearner(proposer, buffer, DraftRegistry(tmp_path / sampling / "drafts"),
                                LearnerConfig(update_interval=100, sampling=sampling, position_policy="verified"), background=False)
        out = SpeculativeDecoder(target, None, proposer, k=3).generate([3, 1, 4, 1, 5, 9], PARAMS, trace=True)
        learner.observe(out, "code", "q1")
        kinds = {"#student@" in r.request_id for r in buffer.records()}
        assert kinds == {"teacher": {False}, "student": {True}, "mixed": {False, True}}[sampling]


def test_learner_budget_is_validated():
    for bad in ({"sampling": "both"}, {"priority": "high"}, {"cpu_share": 0.0}, {"cpu_share": 1.5}, {"threads": 0}, {"gate_metric": "tau"}):
        with pytest.raises(ValueError):
            LearnerConfig(**bad)


@pytest.mark.parametrize("k,hybrid", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_replay_equals_a_live_fixed_k_run(tiny_llama, default_tokenizer, one_thread, k, hybrid):
    """The replayed (accepted, judged) of each request equal the live engine's, head for head,
    and for the hybrid of n-gram lookup and the head, drafter by drafter."""
    torch.manual_seed(0)
    target = tiny_llama(seed=3, vocab_size=len(default_tokenizer), hidden_size=32, head_scale=30.0)
    if hybrid:  # it writes from 8 tokens only, so its text repeats and n-gram lookup finds matches
        with torch.no_grad():
            target.lm_head.weight[torch.ones(len(default_tokenizer), dtype=torch.bool).index_fill_(0, torch.arange(100, 108), False)] = 0
    queries = [Query(id=f"q{i}", domain="code", origin="test", prompt=text) for i, text in enumerate(["def add(a, b):", "Hello there", "1 + 1 ="])]
    signal = build_signal(target, default_tokenizer, queries, SignalConfig(max_new_tokens=40, batch_size=1), progress=False)
    head = FeatureHead.for_target(target, torch.unique(signal.top_ids[:, :2]), intermediate_size=32, num_blocks=1)
    task = ChainTask(signal, ChainConfig(depth=2))  # train it a little: rounds then accept some and reject some
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    for _ in range(60):
        task.step(head, optimizer, task.starts.tolist(), DistillConfig())
    head.requires_grad_(False)
    drafters = {}
    replayed = replay_acceptance(head, signal, k, ngram=(3, 2) if hybrid else None, by_drafter=drafters)
    assert 0 < sum(a for a, _ in replayed) < sum(j for _, j in replayed)  # some accepted, some rejected
    assert set(drafters) == ({"ngram", "head"} if hybrid else {"head"})
    proposer = HybridProposer(FeatureHeadProposer(head), 3, 2) if hybrid else FeatureHeadProposer(head)
    decoder = SpeculativeDecoder(target, default_tokenizer, proposer, k=k)
    for i, (query, (accepted, judged)) in enumerate(zip(queries, replayed)):
        out = decoder.generate(query.prompt, SamplingParams(max_new_tokens=40), trace=True)
        assert len(out.token_ids) == 40  # no EOS: replay is exact up to the last token
        answer = signal.ids[int(signal.starts[i] + signal.prompt_lens[i]): int(signal.starts[i + 1])]
        assert out.token_ids == answer.tolist()
        assert (accepted, judged) == (out.stats.accepted, out.stats.accepted + out.stats.rejected)
        if hybrid and k == HYBRID_REPLAY["k"]:  # the gate's figure: the request's own online record, replayed
            (record,) = records_from_generation(out, "verified", "teacher")
            assert records_replay(head, [record]) == [(accepted, judged)]


def test_stop_abandons_the_update_in_flight_without_publishing(tiny_llama, tmp_path, one_thread):
    target, head = make(tiny_llama)
    proposer = FeatureHeadProposer(head)
    registry = DraftRegistry(tmp_path / "drafts")
    learner = OnlineLearner(proposer, ReplayBuffer(tmp_path / "buffer", policy="window"), registry,
                            LearnerConfig(update_interval=2, steps_per_update=100_000, position_policy="verified", priority="normal"))
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    for prompt in ([3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8]):
        learner.observe(decoder.generate(prompt, PARAMS, trace=True))
    assert learner.busy
    learner.stop()
    assert not learner.busy and registry.versions() == ["v0001"] and not learner.reports


def test_updates_carry_the_optimizer_on_from_the_last_published_draft(tiny_llama, tmp_path, one_thread):
    target, head = make(tiny_llama)
    proposer = FeatureHeadProposer(head)
    learner = OnlineLearner(proposer, ReplayBuffer(tmp_path / "buffer", policy="window"), DraftRegistry(tmp_path / "drafts"),
                            LearnerConfig(update_interval=100, steps_per_update=5, position_policy="verified", gate_margin=1.0),
                            background=False)
    decoder = SpeculativeDecoder(target, None, proposer, k=3)
    for prompt in ([3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8]):
        learner.observe(decoder.generate(prompt, PARAMS, trace=True))
    learner.start_update()
    learner.start_update()
    assert [r.version for r in learner.reports] == ["v0002", "v0003"]
    steps = {int(s["step"]) for s in learner.updater.trainer.optimizer_state["state"].values()}
    assert steps == {2 * 2 * 5}  # Adam's moments went on from the first update instead of restarting (two shifted updates: 10 steps each)
