"""A request that breaks the target fails alone: the requests that share its steps finish with
the target alone's exact output (tiny random models: mechanics only; the served path on the real
model is tests/serve/test_hostile_clients.py).

Three ways a request can break a step: a bad token id in its prompt (refused before it joins), a
bad token in its own forward (its prompt's prefill), and a bad token inside the batched forward
that every running request shares (nobody can tell whose it was: the batch is recomputed, each
request prefilled alone, and the culprit then fails by itself).
"""

from __future__ import annotations

import pytest

from onlinespec.decoding.proposers.base import Proposal
from onlinespec.decoding.proposers.ngram import NgramProposer
from onlinespec.decoding.request import RequestState
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.scheduler import Scheduler
from onlinespec.decoding.speculative import RequestFailed, SpeculativeDecoder
from onlinespec.decoding.stopping import StopChecker

pytestmark = pytest.mark.usefixtures("one_thread")

GOOD = [[1, 4, 2], [5, 0, 3], [2, 2], [1, 4, 2, 1, 4, 2, 1]]
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)
POISON = 4  # a request whose text starts with this token gets a proposal the target cannot embed


class PoisonedProposer(NgramProposer):
    """n-gram proposals, except for requests whose text starts with POISON once they have joined
    the batch (3 tokens generated): a token id past the vocabulary, what a buggy draft or an
    unchecked client id would hand the target, inside the forward every running request shares."""

    def propose(self, batch):
        out = super().propose(batch)
        return [Proposal([10_000]) if d.ids[0] == POISON and len(d.ids) >= 6 else p for d, p in zip(batch, out)]


def _expected(tiny_target, prompts):
    return [SpeculativeDecoder(tiny_target).generate(p, PARAMS).token_ids for p in prompts]


def test_a_token_id_outside_the_vocabulary_is_refused_before_it_joins(tiny_target):
    decoder = SpeculativeDecoder(tiny_target, None, NgramProposer(), k=2)
    for bad in ([1, 6], [1, -1], [999_999_999]):
        with pytest.raises(ValueError, match="not in this model's vocabulary: ids run from 0 to 5"):
            decoder.generate(bad, PARAMS)


def test_a_request_whose_own_forward_fails_fails_alone(tiny_target):
    decoder = SpeculativeDecoder(tiny_target, None, NgramProposer(), k=2, prefill_chunk=2)
    scheduler = Scheduler(decoder.engine, max_batch=5)
    good = [scheduler.submit(decoder.request(p, PARAMS)) for p in GOOD]
    # past the checks that encode_prompt makes: as if a check were missing
    bad = scheduler.submit(RequestState([1, 2, 7, 3], PARAMS, StopChecker(PARAMS, frozenset(), None)))
    scheduler.run()
    assert bad.error is not None and "IndexError" in bad.error
    assert [r.stop.generated for r in good] == _expected(tiny_target, GOOD)


def test_a_token_that_breaks_the_batched_forward_fails_only_its_request(tiny_target, caplog):
    prompts = [*GOOD, [POISON, 1, 1]]
    decoder = SpeculativeDecoder(tiny_target, None, PoisonedProposer(), k=2)
    with pytest.raises(RequestFailed) as failure:
        decoder.generate_many(prompts, PARAMS, max_batch=5)
    assert "a step failed: its 5 requests recompute" in caplog.text, "the batched forward was the one that broke"
    assert failure.value.failed == [len(GOOD)], "only the poisoned request fails"
    assert [g.token_ids for g in failure.value.generations[: len(GOOD)]] == _expected(tiny_target, GOOD)


def test_sampled_requests_beside_a_failure_keep_their_seeded_text(tiny_target):
    """A seeded sampled request's text depends on its seed alone: a recompute in its batch
    (the poisoned request) does not change it."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=123)
    alone = SpeculativeDecoder(tiny_target, None, NgramProposer(), k=2).generate_many(GOOD, params, max_batch=4)
    decoder = SpeculativeDecoder(tiny_target, None, PoisonedProposer(), k=2)
    with pytest.raises(RequestFailed) as failure:
        decoder.generate_many([*GOOD, [POISON, 1, 1]], params, max_batch=5)
    assert [g.token_ids for g in failure.value.generations[: len(GOOD)]] == [g.token_ids for g in alone]


def test_a_proposer_that_raises_leaves_its_requests_undrafted_not_failed(tiny_target):
    class Broken(NgramProposer):
        def propose(self, batch):
            raise RuntimeError("a draft bug")

    decoder = SpeculativeDecoder(tiny_target, None, Broken(), k=2)
    outs = decoder.generate_many(GOOD, PARAMS, max_batch=4)
    assert [o.token_ids for o in outs] == _expected(tiny_target, GOOD)
    assert decoder.engine.draft_failures > 0 and all(o.stats.proposed == 0 for o in outs)
