"""bench/harness.py, the pieces the bench/ scripts share (bench/README.md): the run order, the
result file, and the clear errors when a server cannot start. No model is loaded."""

import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[1] / "bench" / "harness.py"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("bench_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interleave_runs_every_config_on_an_item_before_the_next_rotating_the_first(harness):
    order = harness.interleave(["p0", "p1", "p2", "p3"], ["a", "b", "c"])
    assert order == [("p0", "a"), ("p0", "b"), ("p0", "c"), ("p1", "b"), ("p1", "c"), ("p1", "a"),
                     ("p2", "c"), ("p2", "a"), ("p2", "b"), ("p3", "a"), ("p3", "b"), ("p3", "c")]
    assert harness.interleave([], ["a"]) == []


def test_write_result_adds_command_machine_and_date(harness, tmp_path):
    path = harness.write_result(tmp_path / "new" / "folder" / "r.json", {"tokens_per_s": 80.5}, command=["python", "bench/x.py", "--n", "3"])
    record = json.loads(path.read_text())
    assert record["tokens_per_s"] == 80.5
    assert record["command"] == "python bench/x.py --n 3"
    assert record["date"].endswith("UTC")
    for field in ("cpu_model", "cpu_count", "ram_gib", "python", "torch", "llama_cpp_python", "git_commit", "date"):
        assert field in record["machine"]
    default = json.loads(harness.write_result(tmp_path / "d.json", {}).read_text())
    assert shlex.split(default["command"]) == ["python", *sys.argv]
    kept = json.loads(harness.write_result(tmp_path / "k.json", {"command": "python earlier.py", "machine": {"cpu_model": "x"}}).read_text())
    assert kept["command"] == "python earlier.py" and kept["machine"] == {"cpu_model": "x"}


def test_a_missing_llama_server_binary_says_how_to_build_one(harness, tmp_path, monkeypatch):
    monkeypatch.setenv(harness.LLAMA_SERVER_ENV, str(tmp_path / "nowhere" / "llama-server"))
    with pytest.raises(FileNotFoundError, match="make llama-server"):
        harness.serve_llama_server(tmp_path / "model.gguf").__enter__()


def test_llama_server_gets_parallel_slots_of_the_context_asked(harness, tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv(harness.LLAMA_SERVER_ENV, str(binary))
    command = harness.llama_server_command("m.gguf", 8123, parallel=4, ctx_size=2048, threads=2)
    flags = dict(zip(command[1::2], command[2::2]))
    assert command[0] == str(binary)
    assert flags["-m"] == "m.gguf" and flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"
    assert flags["--parallel"] == "4" and flags["-c"] == str(4 * 2048) and flags["-t"] == flags["-tb"] == "2"
    assert "--cont-batching" in command and "--no-webui" in command


def test_a_server_that_exits_fails_with_its_log_tail(harness, tmp_path):
    command = [sys.executable, "-c", "import sys; print('cannot open the model file', flush=True); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*cannot open the model file"), \
            harness.serve_command(command, "http://127.0.0.1:9", "/health", tmp_path / "server.log", ready_timeout=60):
        pass


def test_serve_onlinespec_and_stream_chat_through_the_openai_client(harness, tiny_target_folder, tmp_path):
    args = ["--target", str(tiny_target_folder), "--draft", "none", "--no-kernels", "--out-dir", str(tmp_path / "run")]
    with harness.serve_onlinespec(args, env={"OMP_NUM_THREADS": "1"}, ready_timeout=180, log_path=tmp_path / "serve.log") as url:
        assert url.startswith("http://127.0.0.1:")
        timing = harness.stream_chat(url, "Say hello.", 6, temperature=0.0)
        again = harness.stream_chat(url, [{"role": "user", "content": "Say hello."}], 6)
    assert url.process.returncode is not None  # stopped on leaving
    assert timing["tokens_from"] == "usage" and 1 <= timing["completion_tokens"] <= 6
    assert timing["text"] == again["text"]  # greedy by default
    assert 0 < timing["ttft_s"] <= timing["total_s"]
    assert timing["finish_reason"] in ("stop", "length")
