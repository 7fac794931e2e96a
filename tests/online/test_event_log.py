"""The event log: rotated by size and age, at most ``keep`` old files, and a purge reaches every
file (a request's lines with --log-text hold its text)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from onlinespec.storage import EventLog


def _lines(log: EventLog) -> list[dict]:
    return [json.loads(line) for file in log.files() for line in file.read_text().splitlines()]


def test_a_log_past_its_size_rotates_keeps_at_most_keep_files_and_a_purge_reaches_them_all(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", max_bytes=400, keep=2)
    for i in range(40):
        log.write({"event": "request", "id": f"r{i}", "text": "x" * 30})
    files = log.files()
    assert [f.name for f in files] == ["events.jsonl", "events.1.jsonl", "events.2.jsonl"]
    assert all(f.stat().st_size <= 400 + 120 for f in files)
    kept = [e["id"] for e in _lines(log)]
    assert "r39" in kept and "r0" not in kept, "the oldest lines went with the oldest file"
    victim = next(i for i in kept if i != "r39" and f"{i}" not in log.path.read_text())  # a line in a rotated file
    assert log.drop(request_id=victim) == 1
    assert victim not in [e["id"] for e in _lines(log)]
    log.close()


def test_a_log_rotates_by_age_and_drops_rotated_files_past_retention(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", retention_seconds=3600, max_age=0.05)
    log.write({"event": "a"})
    time.sleep(0.1)
    log.write({"event": "b"})  # the file is older than max_age: it rotates
    assert len(log.files()) == 2
    old = log.files()[1]
    stale = time.time() - 7200
    os.utime(old, (stale, stale))
    time.sleep(0.1)
    log.write({"event": "c"})  # rotates again: the file past retention goes
    assert all(f.stat().st_mtime > stale + 1 for f in log.files())
    log.close()


def test_writers_append_while_a_purge_rewrites_the_log(tmp_path, monkeypatch):
    """The purge's rewrite is held mid-way (its first copy waits on an Event): a writer appends
    meanwhile, without waiting for it; the lines written meanwhile are kept (or dropped, when
    they are about the purged request) and the swapped-in file takes new lines."""
    from onlinespec import storage

    log = EventLog(tmp_path / "events.jsonl", max_bytes=1 << 20)
    for i in range(50):
        log.write({"event": "request", "id": "victim" if i % 5 == 0 else f"r{i}", "text": "private words"})
    copying, release, original = threading.Event(), threading.Event(), storage.copy_kept

    def held_copy(*args, **kwargs):
        if not copying.is_set():  # the first copy, made without the writers' lock
            copying.set()
            assert release.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(storage, "copy_kept", held_copy)
    dropped: list[int] = []
    purge = threading.Thread(target=lambda: dropped.append(log.drop(request_id="victim")))
    purge.start()
    assert copying.wait(10)
    writer = threading.Thread(target=lambda: [log.write({"event": "request", "id": "meanwhile"}),
                                              log.write({"event": "request", "id": "victim", "text": "late"})])
    writer.start()
    writer.join(5)
    assert not writer.is_alive(), "a writer waited for the purge's rewrite"
    assert purge.is_alive(), "the purge was still rewriting when the writer appended"
    release.set()
    purge.join(30)
    assert dropped == [11]  # 10 lines, and the one written meanwhile
    log.write({"event": "after"})
    ids = [e.get("id") for e in _lines(log)]
    assert "victim" not in ids and "meanwhile" in ids and len(ids) == 42 and ids[-1] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl"], "no copy left beside the log"
    log.close()


def test_a_purge_that_fails_mid_way_leaves_the_log_whole_and_its_copy_goes(tmp_path, monkeypatch):
    from onlinespec import storage

    log = EventLog(tmp_path / "events.jsonl", max_bytes=600, keep=2)
    for i in range(8):
        log.write({"event": "request", "id": f"r{i}"})
    before = log.path.read_bytes()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage, "copy_kept", full_disk)
    with pytest.raises(OSError):
        log.drop(request_id="r3")
    assert log.path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl"]
    monkeypatch.undo()
    for i in range(20):  # writing, and rotating, go on
        log.write({"event": "request", "id": f"s{i}", "text": "x" * 20})
    assert len(log.files()) == 3
    log.close()
    (tmp_path / ".events.jsonl.abc.tmp").write_text('{"id": "r3", "text": "a copy a killed purge left"}\n')
    EventLog(tmp_path / "events.jsonl").close()  # the next start deletes it
    assert not list(tmp_path.glob(".*.tmp"))
