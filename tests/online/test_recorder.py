"""The recorder's alignment: records name the position of the target's correction, and the
teacher row stored there is the target's distribution that produced that correction."""

import dataclasses

import pytest
import torch

from onlinespec.decoding.proposers.base import PerRequestProposer, Proposal
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.online.recorder import record_from_generation


class WrongAtThirdProposer(PerRequestProposer):
    """Proposes the target's own greedy tokens, except that the third proposal of every round is
    wrong: each round accepts 2 and the target corrects the third."""

    name = "scripted"

    def __init__(self, target):
        self.target = target

    def propose_one(self, d):
        ids, k = d.ids, d.k
        tokens = []
        with torch.inference_mode():
            for i in range(k):
                logits = self.target(input_ids=torch.tensor([ids + tokens])).logits[0, -1]
                best = int(logits.argmax())
                tokens.append(best if i != 2 else (best + 1) % logits.shape[-1])
        return Proposal(tokens)


@pytest.fixture
def traced(tiny_target):
    decoder = SpeculativeDecoder(tiny_target, None, WrongAtThirdProposer(tiny_target), k=4, trace_top_k=3)
    return decoder.generate([1, 2, 3], SamplingParams(max_new_tokens=12, ignore_eos=True), trace=True)


def test_rejected_positions_are_the_corrections(tiny_target, traced):
    record = record_from_generation(traced, policy="rejected")
    tokens = record.token_ids
    # Every full round accepts 2 and rejects the 3rd: the error sits at position + 2.
    full_rounds = [r for r in traced.trace if len(r.proposals) >= 3]
    assert record.positions[: len(full_rounds)] == [r.position + 2 for r in full_rounds]
    with torch.inference_mode():
        for t, ids, logprobs in zip(record.positions, record.top_ids, record.top_logprobs):
            # the token at t is the target's correction, and the stored row is the target's
            # distribution computed from the logits at t - 1 (not the ones at t)
            expected = tiny_target(input_ids=torch.tensor([tokens[:t]])).logits[0, -1].log_softmax(-1)
            assert tokens[t] == int(expected.argmax()) == int(ids[0])
            torch.testing.assert_close(logprobs, expected.topk(3).values, rtol=1e-4, atol=1e-5)


def test_bonus_rows_are_not_errors(tiny_target):
    class Perfect(WrongAtThirdProposer):
        def propose_one(self, d):
            return super().propose_one(dataclasses.replace(d, k=min(d.k, 2)))  # never reaches the wrong 3rd

    decoder = SpeculativeDecoder(tiny_target, None, Perfect(tiny_target), k=2, trace_top_k=3)
    out = decoder.generate([4, 5], SamplingParams(max_new_tokens=9, ignore_eos=True), trace=True)
    assert all(r.n_accepted == len(r.proposals) for r in out.trace)  # every round ended on a bonus
    assert record_from_generation(out, policy="rejected") is None
    verified = record_from_generation(out, policy="verified")
    assert verified.positions == list(range(2, 2 + 9))  # every generated position, bonus ones included


def test_verified_policy_skips_rows_conditioned_on_rejected_tokens(traced):
    record = record_from_generation(traced, policy="verified")
    assert record.positions == list(range(3, 3 + 12))  # one row per generated token, nothing after a rejection
    assert len(set(record.positions)) == len(record.positions)


def test_untraced_generation_is_refused(tiny_target):
    out = SpeculativeDecoder(tiny_target, None, None).generate([1, 2], SamplingParams(max_new_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="trace=True"):
        record_from_generation(out)
    with pytest.raises(ValueError, match="position policy"):
        record_from_generation(out, policy="all")
