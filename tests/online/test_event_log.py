"""The event log: rotated by size and age, at most ``keep`` old files, and a purge reaches every
file (a request's lines with --log-text hold its text)."""

from __future__ import annotations

import json
import os
import time

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
