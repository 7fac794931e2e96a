"""Whole-process crash safety of `onlinespec online`: SIGKILL while an update is in flight, then
restart. It must serve the last published draft version, every saved version must load, and no
acknowledged request (one whose row reached the event log) may have lost its buffer record."""

import json
import os
import signal
import subprocess
import sys
import time

from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.registry import DraftRegistry


def write_stream(path, n):
    path.write_text("".join(
        json.dumps({"id": f"q{i}", "domain": "code", "prompt": f"def function_{i}(x):"}) + "\n" for i in range(n)
    ))


def command(tiny_target_folder, stream, out_dir, json_out, steps):
    return [sys.executable, "-m", "onlinespec.cli", "online", "--stream", str(stream), "--json", str(json_out),
            "--out-dir", str(out_dir), "--target", str(tiny_target_folder), "--draft", "target-layers:1", "-k", "2",
            "--max-new-tokens", "8", "--update-interval", "3", "--steps-per-update", str(steps), "--batch-size", "4",
            "--positions", "verified", "--buffer-policy", "window", "--priority", "normal", "--fixed-k", "--no-kernels"]


def events(out_dir):
    path = out_dir / "events.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # a line cut by the kill is not an event


def test_sigkill_during_an_update_then_restart_serves_the_last_published_version(tiny_target_folder, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ONLINESPEC_CACHE": str(tmp_path / "cache")}
    stream, out_dir = tmp_path / "stream.jsonl", tmp_path / "run"
    write_stream(stream, 400)
    proc = subprocess.Popen(command(tiny_target_folder, stream, out_dir, tmp_path / "a.json", steps=60), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline, killed_mid_update = time.time() + 240, False
    try:
        while time.time() < deadline and proc.poll() is None:
            seen = events(out_dir)
            published = [e for e in seen if e["event"] == "update" and e["version"]]
            last_start = max((i for i, e in enumerate(seen) if e["event"] == "update_start"), default=-1)
            in_flight = last_start >= 0 and not any(e["event"] == "update" for e in seen[last_start:])
            if published and in_flight:
                proc.send_signal(signal.SIGKILL)
                killed_mid_update = True
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None and not killed_mid_update:
            proc.kill()
        proc.wait()
    assert killed_mid_update, f"no update was ever caught in flight: {proc.stderr.read().decode()[-2000:]}"

    seen = events(out_dir)
    registry = DraftRegistry(out_dir / "drafts" / "code")  # the stream's one domain has its own draft
    last_published = [e for e in seen if e["event"] == "update" and e["version"]][-1]["version"]
    assert registry.current() == last_published  # the update in flight published nothing
    for version in registry.versions():  # every saved version loads, none half-written
        assert registry.load(version)
    acknowledged = {e["id"] for e in seen if e["event"] == "request"}
    stored = {r.request_id for r in ReplayBuffer(out_dir / "buffer" / "code", policy="window").records()}
    assert acknowledged and acknowledged <= stored

    # restart on the same directory: it resumes with the last published version and the whole buffer
    write_stream(stream, 2)
    again = subprocess.run(command(tiny_target_folder, stream, out_dir, tmp_path / "b.json", steps=2), env=env,
                           capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    start = [e for e in events(out_dir) if e["event"] == "draft"][-1]
    assert start["draft"] == "code"
    assert start["draft_version"] == last_published and start["buffer_records"] >= len(acknowledged)
    rows = json.loads((tmp_path / "b.json").read_text())["requests"]
    assert rows[0]["draft_version"] == last_published


def test_a_stream_compares_online_static_and_target_alone_in_one_run(tiny_target_folder, tmp_path, monkeypatch, one_thread):
    from onlinespec.data import Query
    from onlinespec.online.learner import LearnerConfig
    from onlinespec.serve.config import CoreConfig
    from onlinespec.stream import OnlineConfig, run_stream

    monkeypatch.setenv("ONLINESPEC_CACHE", str(tmp_path / "cache"))
    queries = [Query(id=f"q{i}", domain="code" if i < 4 else "chat", origin="test", prompt=f"def f{i}(x):",
                     train=i != 5) for i in range(8)]
    core = CoreConfig(target=str(tiny_target_folder), draft="target-layers:1", k=2, kernels=False, adaptive_k=False,
                      learner=LearnerConfig(update_interval=3, steps_per_update=2, batch_size=4, priority="normal",
                                            position_policy="verified"))
    config = OnlineConfig(core, max_new_tokens=8, compare_every=2)
    result = run_stream(queries, config, tmp_path / "run")
    rows = result["requests"]
    assert [r["i"] for r in rows] == list(range(8))
    for row in rows:
        assert {"acceptance_rate", "tau", "draft_version", "new_tokens", "seconds", "tokens_per_s", "learner_busy",
                "alpha_moving_average"} <= set(row)
    probed = [r for r in rows if "static" in r]
    assert [r["i"] for r in probed] == [0, 2, 4, 6]
    assert all(r["identical"] for r in probed)  # greedy: online, static and target alone agree token for token
    assert all({"static_learning_off", "online_learning_off", "target_alone"} <= set(r) for r in probed)  # again, learning paused
    comparison = result["comparison"]
    assert comparison["n_requests"] == 4 and comparison["identical"] == 4
    assert set(comparison["tokens_per_s"]) == {"online", "static", "target_alone"}
    low, high = comparison["online/static_95ci"]  # a paired bootstrap interval around the pooled ratio
    assert low <= comparison["tokens_per_s"]["online"] / comparison["tokens_per_s"]["static"] <= high
    assert comparison["learning_on_vs_off"]["static"] > 0
    assert set(result["domains"]) == {"code", "chat"}
    assert [r["draft"] for r in rows] == ["code"] * 4 + ["chat"] * 4  # one draft per domain
    logged = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in logged]
    assert kinds[0] == "start" and "update_start" in kinds and "update" in kinds
    served = [e["draft"] for e in logged if e["event"] == "request"]
    # the stream, its probes served by the static draft, then again in the same pairs, then by the target alone
    assert sorted(served) == sorted(["code"] * 6 + ["chat"] * 6 + ["static"] * 8 + ["none"] * 4)
    # each draft learnt only its own domain's requests; the one marked train: false left nothing
    stored = {d: {r.request_id for r in ReplayBuffer(tmp_path / "run" / "buffer" / d, policy="window").records()}
              for d in ("code", "chat")}
    assert stored == {"code": {"q0", "q1", "q2", "q3"}, "chat": {"q4", "q6", "q7"}}
    assert {u["draft"] for u in result["updates"]} <= {"code", "chat"}
