"""Issue 46, "every byte held has a bound": the replay buffers and the suffix indexes count against
one memory budget (onlinespec.memory); filled past it, they evict by the stated policy (oldest
records from the largest buffer; the least-recently-used tenants' documents), every eviction
reported, and the bytes held, measured apart from the budget's own count, stay under it."""

from __future__ import annotations

import gc
import random
import tracemalloc

import torch

from onlinespec.decoding.proposers.suffix import SuffixIndex
from onlinespec.decoding.proposers.suffix_files import SuffixFiles
from onlinespec.distill.records import DistillRecord
from onlinespec.memory import MemoryBudget, object_bytes, parse_size
from onlinespec.online.buffer import ReplayBuffer

HIDDEN, TOP_K, VOCAB = 576, 32, 49152  # SmolLM2-135M's hidden size and vocabulary, the signal's default top-K


def record(i: int, positions: int = 48) -> DistillRecord:
    """A record of the shapes a feature head's request makes on the default target."""
    g = torch.Generator().manual_seed(i)
    tokens = torch.randint(VOCAB, (positions + 40,), generator=g).tolist()
    return DistillRecord(tokens, list(range(40, 40 + positions)), torch.randint(VOCAB, (positions, TOP_K), generator=g),
                         torch.randn(positions, TOP_K, generator=g).log_softmax(-1), 40, "default", f"req-{i}",
                         torch.randn(positions, HIDDEN, generator=g).half(), [False] * positions)


def measured(buffer: ReplayBuffer) -> int:
    """The buffer's records' bytes, counted here from the records themselves."""
    return sum(object_bytes(part) for r in buffer.records()
               for part in (r.token_ids, r.positions, r.top_ids, r.top_logprobs, r.features, r.rejected))


def test_replay_buffers_filled_to_their_caps_stay_under_the_budget_and_report_evictions(tmp_path):
    one = object_bytes(record(0).features) + object_bytes(record(0).top_ids) + object_bytes(record(0).top_logprobs)
    events: list[dict] = []
    budget = MemoryBudget(limit=12 * one, on_event=events.append)
    # each buffer's own cap (10 records' bytes) is under the budget; three together are not
    buffers = [ReplayBuffer(tmp_path / f"d{n}", max_records=50, max_bytes=10 * one, budget=budget) for n in range(3)]
    for i in range(60):
        buffers[i % 3].add(record(i))
        assert budget.total() <= budget.limit
        assert sum(measured(b) for b in buffers) == budget.used()["replay_buffer"] <= budget.limit
    assert budget.evictions["replay_buffer"] > 0
    evicted = [e for e in events if e["event"] == "memory_evicted"]
    assert evicted and all(e["kind"] == "replay_buffer" and e["records"] >= 1 and e["bytes_after"] < e["bytes_before"] for e in evicted)
    assert sum(e["records"] for e in evicted) == budget.evictions["replay_buffer"]
    for buffer in buffers:  # evicted from disk too: a restart holds what the budget left, and each keeps its newest
        assert len(list(buffer.directory.glob("*.safetensors"))) == len(buffer)
        assert len(buffer) >= 1
    newest = {r.request_id for b in buffers for r in b.records()}
    assert "req-59" in newest and "req-0" not in newest  # the oldest went first
    reopened = ReplayBuffer(buffers[0].directory, max_records=50, max_bytes=10 * one, budget=None)
    assert {r.request_id for r in reopened.records()} == {r.request_id for r in buffers[0].records()}


def suffix_bytes_traced(make) -> tuple[int, object]:
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = make()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - base, index
    finally:
        tracemalloc.stop()


def test_suffix_index_counts_its_bytes_as_tracemalloc_does():
    rng = random.Random(0)

    def fill() -> SuffixIndex:
        index = SuffixIndex(max_tokens=10**6)
        for i in range(400):
            index.add([rng.randrange(VOCAB) for _ in range(120)], f"req-{i}", tenant=f"tenant-{i % 97}")
        return index

    traced, index = suffix_bytes_traced(fill)
    assert 0.9 * traced <= index.memory_bytes() <= 1.1 * traced


def test_suffix_indexes_of_many_tenants_stay_under_their_share(tmp_path):
    events: list[dict] = []
    budget = MemoryBudget(limit=parse_size("8MiB"), suffix_share=0.25, on_event=events.append)
    files = SuffixFiles(tmp_path, max_tokens=10**6, budget=budget)
    index = SuffixIndex()
    files.open("d", index)
    rng = random.Random(1)
    share = budget.limit * budget.suffix_share
    texts = {}
    for i in range(600):  # 600 tenants, one request each: unbounded tenants, bounded bytes
        tenant = f"tenant-{i}"
        texts[tenant] = [rng.randrange(VOCAB) for _ in range(100)]
        index.add(texts[tenant], f"req-{i}", tenant=tenant)
        assert budget.used()["suffix_index"] <= share
    assert budget.evictions["suffix_index"] > 0
    assert any(e["event"] == "memory_evicted" and e["kind"] == "suffix_index" and e["documents"] >= 1 for e in events)
    # the least recently used tenants went; the newest is still found, and a tenant whose lookup
    # kept it in use outlives those that arrived after it
    assert index.match(texts["tenant-599"][:10], 4, tenant="tenant-599") is not None
    assert index.match(texts["tenant-0"][:10], 4, tenant="tenant-0") is None
    kept = "tenant-550"
    for i in range(600, 800):
        index.match(texts[kept][:10], 4, tenant=kept)
        index.add([rng.randrange(VOCAB) for _ in range(100)], f"req-{i}", tenant=f"tenant-{i}")
    assert index.match(texts[kept][:10], 4, tenant=kept) is not None
    assert index.match(texts["tenant-560"][:10], 4, tenant="tenant-560") is None
    files.close("d")
    assert budget.used()["suffix_index"] == 0  # a draft that leaves memory leaves the budget


def test_memory_budget_sizes_parse_and_a_bad_one_is_a_usage_error_that_says_how_to_write_it():
    from typer.testing import CliRunner

    from onlinespec.cli import app

    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512MiB") == 512 * 2**20 and parse_size("300") == 300 * 2**20
    assert parse_size("1.5G") == int(1.5 * 2**30) and parse_size("100MB") == 10**8
    result = CliRunner().invoke(app, ["serve", "--memory-budget", "lots"])
    assert result.exit_code == 2 and "512MiB" in result.output
