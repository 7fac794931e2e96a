"""Replay buffer: bounds, retention policies, and persistence that survives a restart."""

import pytest
import torch

from onlinespec.distill.records import DistillRecord
from onlinespec.online.buffer import ReplayBuffer


def record(i: int, n_positions: int = 2, k: int = 4) -> DistillRecord:
    tokens = list(range(i, i + 10))
    return DistillRecord(tokens, list(range(3, 3 + n_positions)), torch.full((n_positions, k), i),
                         torch.full((n_positions, k), -1.0), prompt_len=3, domain="code", request_id=f"r{i}")


def ids(buffer):
    return [r.request_id for r in buffer.records()]


def test_records_survive_a_restart_intact(tmp_path):
    buffer = ReplayBuffer(tmp_path, policy="window", max_records=10)
    for i in range(4):
        assert buffer.add(record(i))
    (tmp_path / "000000000099.tmp").write_bytes(b"half a record")  # a write cut off by a crash
    reopened = ReplayBuffer(tmp_path, policy="window", max_records=10)
    assert ids(reopened) == ["r0", "r1", "r2", "r3"]
    r = reopened.records()[2]
    assert r.token_ids == list(range(2, 12)) and r.positions == [3, 4] and r.domain == "code" and r.prompt_len == 3
    assert torch.equal(r.top_ids, torch.full((2, 4), 2))
    assert not list(tmp_path.glob("*.tmp"))
    reopened.add(record(4))
    assert ids(ReplayBuffer(tmp_path, max_records=10)) == ["r0", "r1", "r2", "r3", "r4"]


def test_window_keeps_the_most_recent(tmp_path):
    buffer = ReplayBuffer(tmp_path, policy="window", max_records=3)
    for i in range(7):
        buffer.add(record(i))
    assert ids(buffer) == ["r4", "r5", "r6"]
    assert len(list(tmp_path.glob("*.safetensors"))) == 3  # evicted files are deleted


def test_byte_bound(tmp_path):
    one = ReplayBuffer(tmp_path / "probe").add(record(0)) and ReplayBuffer(tmp_path / "probe").nbytes
    buffer = ReplayBuffer(tmp_path / "b", policy="window", max_records=100, max_bytes=int(2.5 * one))
    for i in range(6):
        buffer.add(record(i))
    assert len(buffer) == 2 and buffer.nbytes <= 2.5 * one


def test_clear_policy_empties_after_an_update(tmp_path):
    buffer = ReplayBuffer(tmp_path, policy="clear")
    for i in range(3):
        buffer.add(record(i))
    buffer.after_update()
    assert len(buffer) == 0 and len(ReplayBuffer(tmp_path, policy="clear")) == 0


def test_priority_evicts_what_the_draft_already_knows(tmp_path):
    buffer = ReplayBuffer(tmp_path, policy="priority", max_records=3)
    for i in range(3):
        buffer.add(record(i))
    buffer.set_priorities(list(zip(buffer.records(), [0.9, 0.1, 0.5])))
    buffer.add(record(3))  # unscored: assumed hard; the easiest (r1) goes
    assert ids(buffer) == ["r0", "r2", "r3"]
    assert [r.request_id for r in buffer.sample(2)] == ["r3", "r0"]


def test_reservoir_is_a_uniform_sample(tmp_path):
    """Each of 40 offered records is kept with probability 10/40; over 200 seeded runs every
    index's inclusion count must lie within 5 standard deviations of 50."""
    counts = [0] * 40
    for seed in range(200):
        buffer = ReplayBuffer(tmp_path / str(seed), policy="reservoir", max_records=10, seed=seed)
        for i in range(40):
            buffer.add(record(i, n_positions=1, k=1))
        for r in buffer.records():
            counts[int(r.request_id[1:])] += 1
    sd = (200 * 0.25 * 0.75) ** 0.5
    assert all(abs(c - 50) < 5 * sd for c in counts), counts


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="policy"):
        ReplayBuffer(tmp_path, policy="lru")
    with pytest.raises(ValueError, match="positive"):
        ReplayBuffer(tmp_path, max_records=0)
    with pytest.raises(ValueError, match="retention"):
        ReplayBuffer(tmp_path, retention_seconds=-1)
    with pytest.raises(ValueError, match="a request id or a time"):
        ReplayBuffer(tmp_path).purge()


def test_unreadable_and_stray_files_are_quarantined_not_loaded(tmp_path):
    buffer = ReplayBuffer(tmp_path, max_records=10)
    for i in range(4):
        buffer.add(record(i))
    files = sorted(tmp_path.glob("*.safetensors"))
    files[1].write_bytes(files[1].read_bytes()[:40])  # truncated by a crash of the disk, say
    files[2].write_bytes(b"\x00" * 64)  # corrupt
    (tmp_path / "notes.txt").write_text("a stray file")
    (tmp_path / "state.json").write_text("{not json")
    reopened = ReplayBuffer(tmp_path, max_records=10)
    assert ids(reopened) == ["r0", "r3"]
    assert reopened.counts["quarantined"] == 4
    assert len([p for p in (tmp_path / "quarantine").iterdir() if p.name != "README.txt"]) == 4
    assert reopened.add(record(9)) and ids(ReplayBuffer(tmp_path, max_records=10)) == ["r0", "r3", "r9"]
    # a purge cannot tell whose text an unreadable file holds: every quarantined file goes with it
    assert reopened.purge(request_id="r0") == 1
    assert [p.name for p in (tmp_path / "quarantine").iterdir()] == ["README.txt"]


def test_a_failed_write_stores_nothing_and_the_buffer_goes_on(tmp_path, monkeypatch):
    import onlinespec.online.buffer as module

    buffer = ReplayBuffer(tmp_path, max_records=10)
    buffer.add(record(0))
    real = module.save_file

    def full_disk(tensors, path, metadata=None):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module, "save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        buffer.add(record(1))
    monkeypatch.setattr(module, "save_file", real)
    assert buffer.add(record(2)) and ids(buffer) == ["r0", "r2"]
    assert not list(tmp_path.glob("*.tmp")) and ids(ReplayBuffer(tmp_path)) == ["r0", "r2"]


def test_retention_expires_old_records_even_after_a_clock_jump(tmp_path):
    now = [1_000_000.0]
    buffer = ReplayBuffer(tmp_path, retention_seconds=100, clock=lambda: now[0])
    for i in range(3):
        r = record(i)
        r.created_at = now[0] + i * 40  # 0, 40, 80 s after the start
        buffer.add(r)
    now[0] += 130  # the first is 130 s old, the second 90
    assert buffer.expire() == 1 and ids(buffer) == ["r1", "r2"]
    now[0] += 10_000  # the clock jumps forward: everything is past retention
    assert ids(ReplayBuffer(tmp_path, retention_seconds=100, clock=lambda: now[0])) == []
    assert not list(tmp_path.glob("*.safetensors"))


def test_purge_deletes_a_requests_records_and_its_student_branches(tmp_path):
    buffer = ReplayBuffer(tmp_path)
    for rid in ("a", "a#student@5", "ab", "b"):
        r = record(0)
        r.request_id = rid
        buffer.add(r)
    assert buffer.purge(request_id="a") == 2 and ids(buffer) == ["ab", "b"]
    assert ids(ReplayBuffer(tmp_path)) == ["ab", "b"] and buffer.counts["purged"] == 2
    assert buffer.purge(before=buffer.records()[0].created_at + 1e6) == 2 and len(ReplayBuffer(tmp_path)) == 0


def test_records_of_another_tokenizer_are_refused_with_a_clear_error(tmp_path):
    ReplayBuffer(tmp_path, identity="vocab-49152-aaaa").add(record(0))
    with pytest.raises(ValueError, match="another tokenizer"):
        ReplayBuffer(tmp_path, identity="vocab-32000-bbbb")
