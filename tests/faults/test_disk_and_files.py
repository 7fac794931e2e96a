"""A disk that fills up while serving, corrupt / truncated / stray files, two processes on one
out-dir, another process's rollback, clock jumps under retention."""

from __future__ import annotations

import json
import os
import time

import forked
import pytest
from child import config, prompt

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.registry import DraftRegistry
from onlinespec.serve.core import ServingCore


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=new_tokens)


def test_a_full_disk_skips_records_counts_them_and_serving_goes_on(run_child, restart, tmp_path):
    out = tmp_path / "run"
    run = run_child(out, n=6, fsize=1024)  # no record file fits in 1 KiB
    assert run.returncode == 0 and run.done is not None, run.stderr[-2000:]
    assert [a["id"] for a in run.answers] == [f"r{i}" for i in range(6)]  # every request was answered
    governance = run.done["governance"]
    not_stored = [a["id"] for a in run.answers if not a["recorded"]]
    assert not_stored and governance["write_failures"] >= len(not_stored)
    assert "were NOT stored" not in run.stderr  # skipped and counted, not a crash of the recording path
    found = restart(out, run.acknowledged)  # the disk has room again
    assert found["current"] == DraftRegistry(out / "drafts" / "code").versions()[-1]


def test_corrupt_truncated_and_stray_files_are_quarantined_and_the_newest_valid_version_served(run_child, restart, tmp_path):
    out = tmp_path / "run"
    run = run_child(out, n=6)
    assert run.returncode == 0, run.stderr[-2000:]
    registry = DraftRegistry(out / "drafts" / "code")
    versions = registry.versions()
    assert len(versions) >= 2, "the child published no update"
    newest = out / "drafts" / "code" / versions[-1] / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    buffer_dir = out / "buffer" / "code"
    lost = ReplayBuffer(buffer_dir).records()[0].request_id  # the oldest record file's request
    sorted(buffer_dir.glob("*.safetensors"))[0].write_bytes(b"\x00" * 100)  # corrupt: lost, and never loaded
    (buffer_dir / "notes.txt").write_text("a stray file")
    (out / "drafts" / "code" / "README").write_text("a stray file in the registry: not a version, ignored")
    found = restart(out, [rid for rid in run.acknowledged if rid != lost])
    assert found["current"] == versions[-2] and lost not in found["held"]
    assert found["governance"]["quarantined"] == 3  # the corrupt record, the stray buffer file, the truncated version
    assert (out / "drafts" / "code" / "quarantine").is_dir() and (buffer_dir / "quarantine").is_dir()


def test_a_second_process_on_the_same_out_dir_is_refused_naming_the_holder(tiny_target_folder, tmp_path):
    out = tmp_path / "run"
    core = ServingCore(config(str(tiny_target_folder)), out)
    stream = tmp_path / "stream.jsonl"
    stream.write_text(json.dumps({"prompt": "def f(x):", "domain": "code"}) + "\n")
    try:
        proc = forked.run(["online", "--stream", str(stream), "--json", str(tmp_path / "r.json"), "--out-dir", str(out),
                           "--target", str(tiny_target_folder), "--draft", "target-layers:1"], timeout=120)
    finally:
        core.shutdown(1)
    assert proc.returncode == 2
    assert f"in use by another process (pid {os.getpid()}" in " ".join((proc.stdout + proc.stderr).split())
    assert not (tmp_path / "r.json").exists()


def test_drafts_rollback_from_another_process_takes_effect_in_the_running_one(tiny_target_folder, tmp_path):
    out = tmp_path / "run"
    core = ServingCore(config(str(tiny_target_folder)), out)
    core.load()
    try:
        for i in range(4):
            core.submit(prompt(i), greedy(6), domain="code").result()
            core.pool.wait()  # each update ends before the next request: two published, none due
        learner = core.pool.drafts["code"].learner
        current = learner.registry.current()
        parent = learner.registry.meta(current)["parent"]
        assert parent, "no update was published"
        learner.config.steps_per_update = 10**7  # the next update runs until something stops it
        for i in range(2):
            core.submit(prompt(4 + i), greedy(6), domain="code").result()
        deadline = time.monotonic() + 10
        while not learner.busy:
            assert time.monotonic() < deadline, "no update started"
            time.sleep(0.05)
        rolled = forked.run(["drafts", "rollback", "--dir", str(out / "drafts"), "--draft", "code"], timeout=60)
        assert rolled.returncode == 0, rolled.stdout
        deadline = time.monotonic() + 15
        while learner.publisher.current != parent or learner.busy:
            assert time.monotonic() < deadline, "the running process never took the rollback"
            time.sleep(0.1)
        assert learner.registry.current() == parent and learner.registry.versions()[-1] == current  # nothing published over it
        learner.config.steps_per_update = 2
        assert core.submit(prompt(9), greedy(6), domain="code").result().draft_version == parent
        for i in range(2):  # the next update starts from the rolled-back version
            core.submit(prompt(10 + i), greedy(6), domain="code").result()
        core.pool.wait()
        newest = learner.registry.current()
        assert newest != parent and learner.registry.meta(newest)["parent"] == parent
    finally:
        core.shutdown(5)


def test_a_restart_with_another_target_is_refused_at_start_up(run_child, tiny_target_folder, tmp_path):
    """Another target spec (here the same folder under another name: the registry cannot tell
    it is the same model) on an out-dir whose drafts were trained for the first: refused when
    the core loads, not at the domain's first request."""
    from onlinespec.serve.handles import LoadFailed

    out = tmp_path / "run"
    assert run_child(out, n=2).returncode == 0
    other = tmp_path / "other-target"
    other.symlink_to(tiny_target_folder)
    core = ServingCore(config(str(other)), out)
    with pytest.raises(LoadFailed, match=f"trained for another model .*target: the registry's is '{tiny_target_folder}', "
                                         f"this run's is '{other}'"):
        core.load()
    core.shutdown()
    ServingCore(config(str(tiny_target_folder)), out).shutdown()  # the lock went with it


@pytest.mark.parametrize("jump_days", [2.0, -1.0])
def test_retention_after_a_clock_jump(jump_days, run_child, tiny_target_folder, tmp_path, monkeypatch):
    """Forward past the retention period, every record and event-log line expires; backward,
    nothing is deleted early."""
    out = tmp_path / "run"
    run = run_child(out, n=4)
    assert run.returncode == 0, run.stderr[-2000:]
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + jump_days * 86400)
    core = ServingCore(config(str(tiny_target_folder), retention_days=1.0), out)
    core.load()
    try:
        core.submit("# touch", greedy(2), domain="code", train=False).result()
        held = [r.request_id for r in core.pool.drafts["code"].learner.buffer.records()]
        governance = core.governance()
    finally:
        core.shutdown(5)
    if jump_days > 1:
        assert held == [] and governance["expired"] == len(run.acknowledged)
        first = json.loads((out / "events.jsonl").read_text().splitlines()[0])
        assert first["time"] >= real() + jump_days * 86400 - 3600  # the old lines went at start
    else:
        assert sorted(held) == sorted(run.acknowledged) and governance["expired"] == 0
