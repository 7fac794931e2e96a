"""The prefix cache's index (no model): the longest prefix of the request's own key, never
another tenant's or salt's, at most all but the prompt's last token; LRU eviction within the
budget in cells; entries a newer one covers go; a purge by the request that made an entry.

On the packaged GGUF target (slow): a request that reuses cached cells computes exactly what the
same request computes when its prompt runs in the same two pieces without the cache (the copy is
bit-exact); a live request takes the least recently used entry's sequence when none is free."""

from __future__ import annotations

import pytest
import torch

from onlinespec import memory
from onlinespec.decoding.prefix_cache import PrefixCache

A, B = ("tenant-a", ""), ("tenant-b", "")


def test_lookup_finds_the_longest_prefix_of_the_same_key_only():
    cache = PrefixCache(1000)
    cache.add(A, [1, 2, 3, 4, 5], seq=0, owner="r1")
    cache.add(A, [1, 2, 9], seq=1, owner="r2")
    entry, n = cache.lookup(A, [1, 2, 3, 4, 7, 8])
    assert (entry.seq, n) == (0, 4)
    assert cache.lookup(B, [1, 2, 3, 4, 7, 8]) == (None, 0), "another tenant never hits these cells"
    assert cache.lookup(("tenant-a", "salt"), [1, 2, 3, 4, 7]) == (None, 0), "nor another cache_salt of the same tenant"
    entry, n = cache.lookup(A, [1, 2, 3, 4, 5])
    assert n == 4, "the prompt's last token always runs: its logits choose the first new token"


def test_budget_evicts_the_least_recently_used_and_covered_entries_go():
    cache = PrefixCache(10)
    assert cache.add(A, [1, 2, 3, 4], seq=0, owner="r1") == []
    assert cache.add(B, [5, 6, 7, 8], seq=1, owner="r2") == []
    cache.lookup(A, [1, 2, 3, 4, 0])  # A's entry is used: B's is now the least recent
    assert cache.add(A, [9, 9, 9, 9], seq=2, owner="r3") == [1], "past 10 cells, the least recently used entry goes"
    assert cache.cells == 8 and cache.evicted_cells == 4
    assert cache.add(A, [1, 2, 3, 4, 5, 6], seq=3, owner="r4") == [0], "an entry a newer one extends is dropped"
    assert cache.evict(keep=cache.entries[0]) is not None and len(cache.entries) == 1
    assert cache.evict(keep=cache.entries[0]) is None, "the entry kept for a hit is never the one evicted"


def test_purge_drops_the_entries_of_the_request_that_made_them():
    cache = PrefixCache(100)
    cache.add(A, [1, 2, 3], seq=0, owner="gone")
    cache.add(B, [1, 2, 3], seq=1, owner="kept")
    assert cache.purge("gone") == [0]
    assert cache.lookup(A, [1, 2, 3, 4]) == (None, 0)
    assert cache.lookup(B, [1, 2, 3, 4])[1] == 3
    assert cache.purge(before=float("inf")) == [1] and cache.cells == 0


def test_a_budget_below_one_cell_is_refused():
    with pytest.raises(ValueError, match="at least 1 cell"):
        PrefixCache(0)


class Row:
    """A request as the runner sees it: keyed on identity, with a cache key."""

    def __init__(self, key=A, owner=None):
        self.cache_key, self.cache_owner, self.error = key, owner, None


@pytest.fixture(scope="module")
def target():
    pytest.importorskip("llama_cpp")
    from onlinespec.models import load_target

    return load_target("default", backend="auto", device="cpu")


@pytest.mark.slow
@torch.inference_mode()
def test_reused_cells_compute_exactly_what_the_same_pieces_compute(target):
    ids = target.tokenizer("The committee met on Tuesday to discuss the budget for the new library. " * 4).input_ids[:60]
    cached = target.runner(2, context=256, prefix_cache=True)
    first = Row(owner="turn-1")
    cached.forward_alone(first, ids[:40], 1)
    cached.release([first])  # its 40 cells stay as an entry
    assert cached.prefix_cache.cells == 40
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, keys and values in f16
    assert memory.budget().used()["prefix_cache"] >= 40 * 30 * 3 * 64 * 2 * 2, "cached cells count in the server's memory budget"
    second = Row()
    assert cached.reuse(second, ids, 16) == 40
    logits_on, _ = cached.forward_alone(second, ids[40:], 1)
    assert cached.reuse(Row(key=B), ids, 16) == 0, "another tenant's prompt runs whole"

    plain, row = target.runner(2, context=256), object()
    plain.prefill(row, ids[:40])
    logits_off, _ = plain.forward_alone(row, ids[40:], 1)
    assert torch.equal(logits_on, logits_off), "copied cells are the computed ones, bit for bit"
    assert plain.reuse(object(), ids) is None, "no prefix cache unless asked"

    cached.release([second])
    assert cached.purge_prefix("turn-1") == 0, "the second request's entry covered the first's (the first is gone already)"
    assert cached.prefix_cache.cells == len(ids) and cached.purge_prefix(before=float("inf")) == len(ids)


@pytest.mark.slow
def test_a_live_request_takes_the_sequence_of_the_least_recently_used_entry(target):
    runner = target.runner(1, context=128, prefix_cache=True, prefix_cache_cells=128)  # one batch sequence, one cache sequence
    ids = list(range(100, 140))
    for n in range(3):  # each request leaves an entry; the third needs a sequence the first two hold
        row = Row(key=(f"tenant-{n}", ""))
        runner.prefill(row, ids)
        runner.release([row])
    assert len(runner.prefix_cache.entries) == 2 and runner.prefix_cache.evicted_cells == 40
    assert runner.reuse(Row(key=("tenant-2", "")), ids + [7], 16) == 40


def test_serve_takes_vllms_prefix_caching_flags(tmp_path, monkeypatch):
    """`--enable-prefix-caching` (the default) / `--no-enable-prefix-caching` and
    `--prefix-cache-cells` reach the core's config (nothing starts); a budget below 1 exits 2."""
    from typer.testing import CliRunner

    from onlinespec import cli
    from onlinespec.cli import app
    from onlinespec.serve import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda make_core, host, port, settings, logs: seen.update(core=make_core.args[0]))
    monkeypatch.setattr(cli.serving, "private_files", lambda: None)
    out = ["--out-dir", str(tmp_path / "run"), "--backend", "torch"]
    runner = CliRunner()
    assert runner.invoke(app, ["serve", "models/tiny", *out]).exit_code == 0
    assert seen["core"].enable_prefix_caching and seen["core"].prefix_cache_cells is None
    result = runner.invoke(app, ["serve", "models/tiny", "--no-enable-prefix-caching", "--prefix-cache-cells", "2048", *out])
    assert result.exit_code == 0, result.output
    assert (seen["core"].enable_prefix_caching, seen["core"].prefix_cache_cells) == (False, 2048)
    assert runner.invoke(app, ["serve", "models/tiny", "--prefix-cache-cells", "0", *out]).exit_code == 2


@pytest.mark.slow
def test_a_preempted_request_prefills_from_its_own_cells_when_readmitted(target):
    """Issue 46: a choice preempted for another tenant prefilled its whole text again (prompt and
    every token it had generated) when readmitted, its chunks riding in the others' steps; its
    cells now stay in the prefix cache as it leaves, and it starts from them: it prefills what
    it had not computed (one token), and its text is the one it would have had unpreempted."""
    from onlinespec.decoding.engine import SpeculativeEngine
    from onlinespec.decoding.request import RequestState
    from onlinespec.decoding.sampling import SamplingParams
    from onlinespec.decoding.scheduler import FairScheduler
    from onlinespec.decoding.stopping import StopChecker

    ids = target.tokenizer("Tell me a story about a lighthouse keeper.").input_ids

    def served(preempt: bool) -> tuple[list[int], int]:
        engine = SpeculativeEngine(target.runner(2, context=256, prefix_cache=True), frozenset(), k=0)
        scheduler = FairScheduler(engine, max_batch=1, quantum=4)  # one slot, two tenants: time slices
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        b = RequestState(list(ids), params, StopChecker(params, frozenset(), None), cache_key=A)
        scheduler.submit(b, tenant="B")
        while len(b.stop.generated) < 20:
            scheduler.step()
        readmitted = None
        if preempt:
            a_params = SamplingParams(max_new_tokens=3, ignore_eos=True)
            scheduler.submit(RequestState([5, 6, 7], a_params, StopChecker(a_params, frozenset(), None), cache_key=B), tenant="A")
            while b in scheduler.running:  # until its time slice ends
                scheduler.step()
            assert scheduler.preempted == 1 and len(b.stop.generated) < 40
            while b not in scheduler.running:  # A runs, then B is readmitted
                _, report = scheduler.step()
            readmitted = report.prefill_tokens
        scheduler.run()
        return b.stop.generated, readmitted

    unpreempted, _ = served(False)
    text, prefilled = served(True)
    assert prefilled == 1  # before: its prompt and 20 generated tokens again
    assert text == unpreempted
