"""The suffix index of earlier requests: what it proposes, what it forgets, what it keeps on disk,
and that drafting from it stays lossless (greedy identical, sampled output the target's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_lossless_engine import N_RUNS, NEW_TOKENS, PASS_P, PLAIN, PROMPT, SEED_BASE, exact_distribution, fit

from onlinespec.decoding.acceptance import AdaptiveK
from onlinespec.decoding.adaptive import proposal_budget
from onlinespec.decoding.proposal import Proposal
from onlinespec.decoding.proposers.base import DraftInput
from onlinespec.decoding.proposers.suffix import SuffixIndex, SuffixProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder


def test_the_longest_earlier_match_decides_then_the_most_frequent_continuation():
    index = SuffixIndex()
    index.add([7, 1, 2, 3, 4, 5], "a")  # after 7 1 2 3: 4 5
    for i in range(3):
        index.add([8, 1, 2, 3, 9, 9], f"b{i}")  # after 1 2 3 (three times): 9 9
    longest = index.match([7, 1, 2, 3], 2)
    assert longest.tokens == [4, 5] and longest.match_length == 4 and longest.support == 1
    frequent = index.match([0, 1, 2, 3], 2)
    assert frequent.tokens == [9, 9] and frequent.support == 4
    assert frequent.confidences[0] == pytest.approx(3 / 5)  # 3 of 4 occurrences, shrunk: count / (n + 1)
    assert index.match([5, 6], 3) is None  # never seen


def test_ties_go_to_the_newest_and_no_match_crosses_a_request():
    index = SuffixIndex()
    index.add([1, 2, 3], "old")
    index.add([1, 2, 4], "new")
    assert index.match([1, 2], 1).tokens == [4]
    index = SuffixIndex()
    index.add([5, 6], "short")  # under three tokens: nothing to learn
    index.add([1, 2, 3], "a")
    index.add([4, 5, 6], "b")
    assert index.match([1, 2], 4).tokens == [3]  # stops at the end of its request, never runs into the next


def test_memory_is_bounded_and_the_oldest_requests_go_first():
    index = SuffixIndex(max_tokens=50)
    for i in range(40):
        index.add([100 + i, 1, 2, 1000 + i], f"r{i}")
    assert index.tokens <= 50 and index.counts["evicted"] == 40 - len(index)
    assert index.match([1, 2], 1).tokens == [1039]
    assert index.match([100, 1, 2], 1).tokens == [1039]  # r0 is gone: its longer match no longer exists


def test_purge_and_retention_forget_requests(tmp_path):
    now = [1000.0]
    index = SuffixIndex(clock=lambda: now[0])
    index.add([1, 2, 3, 4], "secret")
    index.add([5, 6, 7, 8], "kept")
    assert index.purge(request_id="secret") == 1 and index.match([1, 2], 2) is None
    now[0] += 100
    index.add([9, 8, 7, 1], "new")
    assert index.expire(50) == 1  # "kept" was indexed 100 s ago
    assert index.match([5, 6], 2) is None and index.match([9, 8], 1).tokens == [7]


def test_saved_and_loaded_it_proposes_the_same(tmp_path):
    index = SuffixIndex()
    for i in range(5):
        index.add([1, 2, 3, 4 + i % 2, 7], f"r{i}", created_at=float(i))
    index.save(tmp_path / "index.safetensors")
    again = SuffixIndex()
    again.load(tmp_path / "index.safetensors")
    assert again.stats() == index.stats() and again.match([1, 2, 3], 3) == index.match([1, 2, 3], 3)
    assert again.purge(before=2.0) == 2  # arrival times survive the round trip
    (tmp_path / "bad.safetensors").write_bytes(b"not an index")
    with pytest.raises(Exception):
        SuffixIndex().load(tmp_path / "bad.safetensors")


def test_the_proposer_copies_the_request_first_then_earlier_requests():
    index = SuffixIndex()
    index.add([10, 11, 12, 13, 14], "earlier")
    proposer = SuffixProposer(index, min_match=2)
    greedy = SamplingParams(temperature=0.0)
    own, earlier = proposer.propose([DraftInput([5, 6, 7, 5, 6], 2, greedy, None), DraftInput([9, 11, 12], 2, greedy, None)])
    assert own.drafter == "ngram" and own.tokens == [7, 5]
    assert earlier.drafter == "suffix" and earlier.tokens == [13, 14] and len(earlier.confidences) == 2


def test_greedy_from_the_index_is_identical_to_the_target_alone_and_accepted(tiny_target):
    alone = SpeculativeDecoder(tiny_target, None, None)
    params = SamplingParams(max_new_tokens=24)
    prompt = [1, 4, 2, 5]
    reference = alone.generate(prompt, params)
    index = SuffixIndex()
    index.add(reference.prompt_ids + reference.token_ids, "the same question before")
    spec = SpeculativeDecoder(tiny_target, None, SuffixProposer(index), k=4).generate(prompt, params)
    assert spec.token_ids == reference.token_ids
    assert spec.stats.acceptance_rate > 0.9  # the target says again what it said


def test_a_confident_copy_is_verified_even_where_drafting_does_not_pay_on_average(tiny_target):
    """On a target whose wide forwards are dear (a CPU's), the step budget drafts nothing when
    past proposals were mostly rejected; lookups cost nothing, so they still draft, and a copy the
    index has seen many times is verified, accepted, and the output stays the target's."""
    alone = SpeculativeDecoder(tiny_target, None, None)
    params = SamplingParams(max_new_tokens=24)
    prompt = [1, 4, 2, 5]
    reference = alone.generate(prompt, params)
    index = SuffixIndex()
    for i in range(9):  # confidence 9 / 10
        index.add(reference.prompt_ids + reference.token_ids, f"asked before {i}")
    adaptive = AdaptiveK([1.0, 1.3, 1.6, 1.9, 2.2], explore_every=10**6)
    for _ in range(50):  # a history of rejected drafts: on average, drafting does not pay
        adaptive.update(Proposal([0, 0, 0, 0], drafter="head"), 0, use_confidence=True)
    assert proposal_budget([adaptive], 4) == 0
    spec = SpeculativeDecoder(tiny_target, None, SuffixProposer(index), k=4, adaptive_k=adaptive).generate(prompt, params)
    assert spec.token_ids == reference.token_ids
    assert spec.stats.proposed >= 12 and spec.stats.acceptance_rate > 0.9


def test_sampling_from_the_index_matches_the_target_distribution(tiny_target, chi_square):
    """Point masses from earlier requests, several continuations per match: the target's
    distribution all the same. N = 3000 (the engine tests' N_RUNS), p > 1e-3."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, **PLAIN)
    exact = exact_distribution(tiny_target, PROMPT, params)
    index = SuffixIndex()
    gen = torch.Generator().manual_seed(3)
    for i in range(30):  # earlier requests that began like this one and went on in many ways
        index.add(PROMPT + torch.randint(0, 6, (5,), generator=gen).tolist(), f"r{i}")
    decoder = SpeculativeDecoder(tiny_target, None, SuffixProposer(index, min_match=2), k=2)
    # unseeded requests (a seeded one drafts from its own text only): the process's RNG, seeded once
    torch.manual_seed(SEED_BASE)
    counts, totals = {}, {"accepted": 0, "rejected": 0}
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, **PLAIN)
    for _ in range(N_RUNS):
        out = decoder.generate(PROMPT, params)
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        totals["accepted"] += out.stats.accepted
        totals["rejected"] += out.stats.rejected
    assert totals["accepted"] > N_RUNS / 10 and totals["rejected"] > N_RUNS / 10, totals
    p_value, stat, df = fit(counts, exact, chi_square)
    assert p_value > PASS_P, (p_value, stat, df)


def test_the_hybrid_takes_the_index_only_when_it_is_expected_to_go_further(tiny_draft):
    from onlinespec.decoding.adaptive import AdaptiveK
    from onlinespec.decoding.proposers.base import Proposal
    from onlinespec.decoding.proposers.draft_model import DraftModelProposer
    from onlinespec.decoding.proposers.hybrid import HybridProposer

    index = SuffixIndex()
    index.add([0, 3, 1, 2, 5, 4], "once")  # one occurrence: confidence 1/2 per token
    hybrid = HybridProposer(DraftModelProposer(tiny_draft), suffix_index=index)
    greedy = SamplingParams(temperature=0.0)
    ask = lambda adaptive: hybrid.propose([DraftInput([4, 3, 1, 2], 2, greedy, None, adaptive=adaptive)])[0].drafter  # noqa: E731
    assert ask(None) == "suffix"  # nothing measured: the free proposal
    stats = AdaptiveK([1.0, 1.0, 1.0])
    for _ in range(200):  # the draft model has been accepted almost always, the index's half-sure guesses never
        stats.update(Proposal([1, 2], drafter="draft"), 2, use_confidence=True)
        stats.update(Proposal([1, 2], confidences=[0.5, 0.5], drafter="suffix"), 0, use_confidence=True)
    assert ask(stats) == "draft"


def test_the_hybrid_asks_the_learned_draft_for_at_most_learned_k_tokens(tiny_draft):
    from onlinespec.decoding.proposers.draft_model import DraftModelProposer
    from onlinespec.decoding.proposers.hybrid import HybridProposer

    hybrid = HybridProposer(DraftModelProposer(tiny_draft), suffix_index=SuffixIndex(), learned_k=2)
    greedy = SamplingParams(temperature=0.0)
    learned, copied = hybrid.propose([DraftInput([0, 1, 2, 3], 6, greedy, None), DraftInput([1, 2, 3, 4, 5, 1, 2], 6, greedy, None)])
    assert learned.drafter == "draft" and len(learned) == 2  # each learned token costs a draft step
    assert copied.drafter == "ngram" and copied.tokens == [3, 4, 5, 1, 2]  # copies are free: up to k


def test_a_save_taken_before_a_purge_never_lands_after_it(tmp_path):
    import threading

    from onlinespec import storage

    index = SuffixIndex()
    index.add([1, 2, 3, 4], "secret")
    path = tmp_path / "index.safetensors"
    write, started, release = storage.atomic_write, threading.Event(), threading.Event()

    def slow_write(p, data):  # the housekeeping save, stalled between its snapshot and its write
        started.set()
        release.wait(5)
        write(p, data)

    import onlinespec.storage as module
    module.atomic_write = slow_write
    try:
        housekeeping = threading.Thread(target=index.save, args=(path,))
        housekeeping.start()
        started.wait(5)
        module.atomic_write = write
        purging = threading.Thread(target=lambda: (index.purge(request_id="secret"), index.save(path)))
        purging.start()
        release.set()
        housekeeping.join(5)
        purging.join(5)
    finally:
        module.atomic_write = write
    saved = SuffixIndex()
    saved.load(path)
    assert len(saved) == 0 and not index.dirty  # the purge's save landed last


def test_a_seeded_sampled_request_drafts_from_its_own_text_only():
    index = SuffixIndex()
    index.add([10, 11, 12, 13, 14], "someone else")
    proposer = SuffixProposer(index, min_match=2)
    seeded = SamplingParams(temperature=0.8, seed=1)
    [own] = proposer.propose([DraftInput([9, 11, 12], 2, seeded, None)])
    assert own.tokens == []  # its text depends on its seed alone, never on other requests


def test_an_index_whose_parts_disagree_or_name_no_tokenizer_is_refused(tmp_path):
    from safetensors.numpy import save_file

    from onlinespec.decoding.proposers.suffix import FORMAT, IdentityMismatch

    path = tmp_path / "index.safetensors"
    save_file({"tokens": np.arange(5, dtype=np.int32), "lengths": np.asarray([9]), "created_at": np.asarray([0.0])}, str(path),
              metadata={"format": FORMAT, "tokenizer": "t", "request_ids": '["a"]'})
    with pytest.raises(ValueError, match="do not add up"):
        SuffixIndex().load(path)
    unnamed = SuffixIndex()
    unnamed.add([1, 2, 3], "a")
    unnamed.save(path)
    mine = SuffixIndex()
    mine.identity = "this tokenizer"
    with pytest.raises(IdentityMismatch):
        mine.load(path)


def test_an_index_purged_on_disk_keeps_its_tokenizer_so_its_server_starts_again(tmp_path):
    """A purge of a saved index (``onlinespec data purge``, or a draft that is not in memory)
    opens it without knowing the tokenizer: the file it saves again still names it."""
    path = tmp_path / "index.safetensors"
    index = SuffixIndex()
    index.identity = "tok"
    index.add([1, 2, 3, 4], "secret")
    index.add([1, 2, 3, 5], "kept")
    index.save(path)
    offline = SuffixIndex()
    offline.load(path)
    assert offline.purge(request_id="secret") == 1
    offline.save(path)
    again = SuffixIndex()
    again.identity = "tok"
    again.load(path)
    assert len(again) == 1

def test_a_pools_index_files_are_loaded_set_aside_saved_and_purged(tmp_path):
    """SuffixFiles keeps each draft's index in <root>/<draft>/: loaded when its draft opens, an
    unreadable file set aside (the index starts empty), a file of another tokenizer refused; a
    purge reaches the indices in memory and those saved only, and deletes set-aside copies."""
    from onlinespec.decoding.proposers.suffix import IdentityMismatch
    from onlinespec.decoding.proposers.suffix_files import SUFFIX_FILE, SuffixFiles, purge_saved_suffix

    files = SuffixFiles(tmp_path, max_tokens=1000, identity="tok")
    index = SuffixIndex()
    files.open("a", index)
    index.add([1, 2, 3, 4], "secret")
    index.add([5, 6, 7, 8], "kept")
    files.close("a")  # its draft leaves memory: saved
    again = SuffixIndex()
    files.open("a", again)
    assert len(again) == 2 and again.max_tokens == 1000
    with pytest.raises(IdentityMismatch):
        SuffixFiles(tmp_path, identity="another tokenizer").open("a", SuffixIndex())
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / SUFFIX_FILE).write_bytes(b"\x00" * 40)
    fresh = SuffixIndex()
    files.open("b", fresh)
    assert len(fresh) == 0 and list((tmp_path / "b" / "quarantine").glob(f"{SUFFIX_FILE}.*"))
    fresh.add([1, 2, 3, 9], "secret")
    assert files.purge(request_id="secret") == 2 and len(again) == 1 and len(fresh) == 0
    assert not list((tmp_path / "b" / "quarantine").iterdir())  # a set-aside copy may hold the request
    files.close("a")
    assert purge_saved_suffix(tmp_path, request_id="kept") == 1  # on disk only: a stopped server's, or an evicted draft's
    files.open("a", again)
    assert len(again) == 0
