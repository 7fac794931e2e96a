"""The command line as a user meets it: bench writes the promised figures; bad input is refused clearly."""

import json

import pytest
from typer.testing import CliRunner

from onlinespec.cli import app

runner = CliRunner()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_bench_writes_side_by_side_figures(tmp_path, backend):
    """torch: beside HF assisted generation; auto: the packaged GGUF on llama.cpp (no HF there). k = 4:
    the torch cost curve it calibrates is the one test_greedy_identity's adaptive test reads (the
    same target, k and batch size), measured once for both."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}], "domain": "code"}\n'
        '{"prompt": "The capital of France is", "domain": "chat", "max_new_tokens": 6}\n'
    )
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "--prompts", str(prompts), "--json", str(out), "--draft", "ngram",
                                 "--k", "4", "--max-new-tokens", "12", "--backend", backend])
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert summary["n_prompts"] == 2 and summary["k"] == 4 and summary["draft"] == "ngram"
    hf = backend == "torch"
    assert summary["config"]["backend"] == ("torch" if hf else "llama.cpp")
    for key in ("speedup_vs_target", "predicted_speedup") + (("speedup_vs_hf",) if hf else ()):
        assert summary[key] > 0
    assert summary["speculative"]["greedy_identical"] == 2
    for fig in (summary, *summary["domains"].values()):
        for method in ("target_alone", "speculative") + (("hf_assisted",) if hf else ()):
            assert fig[method]["tokens_per_s"] > 0
        assert 0 <= fig["speculative"]["acceptance_rate"] <= 1
        assert fig["speculative"]["mean_accepted_length"] >= 1
    assert set(summary["domains"]) == {"code", "chat"}
    assert summary["prompts"][1]["new_tokens"]["target_alone"] <= 6  # the per-prompt max_new_tokens is honoured
    assert summary["cost_model"]["c_by_drafter"].keys() <= {"ngram"}  # c per drafter (the n-gram lookup here)
    if not hf:  # plain llama.cpp on the file as given, beside ours, and the file each one ran
        from onlinespec.formats import served_file
        from onlinespec.models import default_gguf_path

        assert summary["llama_cpp"]["tokens_per_s"] > 0 and summary["speedup_vs_llama_cpp"] > 0
        assert summary["llama_cpp_file"] == str(default_gguf_path())  # what a user runs: the file as shipped
        assert summary["target_file"] == str(served_file(default_gguf_path(), "auto"))  # ours: the format chosen on this machine


def test_bench_reports_the_bad_line(tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"promt": "typo"}\n')
    result = runner.invoke(app, ["bench", "--prompts", str(prompts), "--json", str(tmp_path / "o.json")])
    assert result.exit_code == 2
    assert "bad.jsonl:2" in result.output.replace("\n", "")  # rich wraps a long path
    assert not (tmp_path / "o.json").exists()


def test_generate_refuses_bad_sampling_settings():
    result = runner.invoke(app, ["generate", "hi", "--top-p", "1.5"])
    assert result.exit_code == 2
    assert "top_p" in result.output


def test_costmodel_prints_best_k():
    result = runner.invoke(app, ["costmodel", "--alpha", "0.6", "--c", "0.05", "--k-max", "10"])
    assert result.exit_code == 0
    assert "best k: 4" in result.output


def test_data_stream_exports_a_shift_schedule(tmp_path):
    out = tmp_path / "stream.jsonl"
    result = runner.invoke(app, ["data", "stream", "--out", str(out), "--domains", "code,chat", "--every", "5"])
    assert result.exit_code == 0, result.output
    domains = [json.loads(line)["domain"] for line in out.read_text().splitlines()]
    assert domains == ["code"] * 5 + ["chat"] * 5
    bad = runner.invoke(app, ["data", "stream", "--out", str(out), "--schedule", "zigzag"])
    assert bad.exit_code == 2 and "zigzag" in bad.output


@pytest.mark.slow
def test_online_serves_a_stream_learns_and_reports(tmp_path, tiny_target_folder):
    """The command's mechanics, on the tiny target (the demo test runs the real one)."""
    stream = tmp_path / "stream.jsonl"
    stream.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"Write a Python function number {i} that adds numbers."}],
                    "domain": "code" if i < 3 else "chat", **({"train": False} if i == 5 else {})}) + "\n"
        for i in range(6)
    ))
    out_json, out_dir = tmp_path / "online.json", tmp_path / "run"
    result = runner.invoke(app, ["online", "--stream", str(stream), "--json", str(out_json), "--out-dir", str(out_dir),
                                 "--max-new-tokens", "8", "--update-interval", "2", "--steps-per-update", "2",
                                 "--target", str(tiny_target_folder), "--draft", "target-layers:1", "--k", "2", "--no-kernels",
                                 "--fixed-k", "--positions", "verified"])
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    rows = data["requests"]
    assert [r["i"] for r in rows] == list(range(6))
    for row in rows:
        assert {"domain", "acceptance_rate", "draft_version", "new_tokens", "seconds"} <= set(row)
    assert set(data["domains"]) == {"code", "chat"} and data["summary"]["n_requests"] == 6
    assert data["updates"], "an update every 2 requests: some must have run"
    events = [json.loads(line) for line in (out_dir / "events.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "request" for e in events) == 6 and any(e["event"] == "update" for e in events)
    assert (out_dir / "report.md").exists() and (out_dir / "alpha.png").stat().st_size > 0
    assert (out_dir / "drafts" / "code" / "CURRENT").exists() and (out_dir / "drafts" / "chat" / "CURRENT").exists()
    listed = runner.invoke(app, ["drafts", "list", "--dir", str(out_dir / "drafts")])  # every draft of the run
    assert listed.exit_code == 0 and "draft code" in listed.stdout and "draft chat" in listed.stdout
    ambiguous = runner.invoke(app, ["drafts", "rollback", "--dir", str(out_dir / "drafts")])
    assert ambiguous.exit_code == 2 and "--draft" in ambiguous.output


def test_drafts_lists_versions_and_rolls_back(tmp_path):
    import torch

    from onlinespec.online.registry import DraftRegistry

    registry = DraftRegistry(tmp_path / "drafts")
    registry.publish({"w": torch.zeros(2)}, {"parent": None, "note": "starting draft"})
    registry.publish({"w": torch.ones(2)}, {"parent": "v0001", "records_seen": 40, "alpha_before": 0.2, "alpha_after": 0.3})
    listed = runner.invoke(app, ["drafts", "list", "--dir", str(tmp_path / "drafts")])
    assert listed.exit_code == 0 and "v0001" in listed.stdout and "* v0002" in listed.stdout and "0.3000" in listed.stdout
    back = runner.invoke(app, ["drafts", "rollback", "--dir", str(tmp_path / "drafts")])
    assert back.exit_code == 0 and registry.current() == "v0001"
    again = runner.invoke(app, ["drafts", "rollback", "--dir", str(tmp_path / "drafts")])
    assert again.exit_code == 2 and "no parent" in again.output
    named = runner.invoke(app, ["drafts", "rollback", "--dir", str(tmp_path / "drafts"), "--to", "v0009"])
    assert named.exit_code == 2 and "no draft version" in named.output
    assert runner.invoke(app, ["drafts", "rollback", "--dir", str(tmp_path / "drafts"), "--to", "v0002"]).exit_code == 0
    assert registry.current() == "v0002"


@pytest.mark.slow
def test_demo_serves_a_shift_stream_and_compares_online_static_fresh_and_target_alone(tmp_path):
    previous = tmp_path / "run" / "drafts" / "math_ml"  # a previous demo's draft: the demo starts afresh, never from it
    previous.mkdir(parents=True)
    (previous / "CURRENT").write_text("v0042")
    # one in flight: at batch 1 a draft can pay, so each draft records what it serves (at batch 4 on a
    # CPU adaptive k may draft nothing, and then nothing is recorded: onlinespec.online.learner.records_next)
    # 8 steps an update: the comparison waits for the update in flight (160 steps: 30 s on a core here)
    result = runner.invoke(app, ["demo", "--per-domain", "3,2,2", "--max-new-tokens", "6", "--update-interval", "2", "--steps-per-update", "8",
                                 "--compare-every", "1", "--concurrency", "1", "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "removed the previous demo run" in result.output
    data = json.loads((tmp_path / "online.json").read_text())
    assert [r["domain"] for r in data["requests"]] == ["math_ml"] * 3 + ["code", "code", "chat", "chat"]
    assert [r["draft"] for r in data["requests"]] == ["math_ml"] * 3 + ["code", "code", "chat", "chat"]
    assert data["requests"][0]["draft_version"] == "v0001"
    comparison = data["comparison"]
    assert comparison["n_requests"] == 7 and comparison["identical"] == 7  # online, static, fresh and the target alone agree
    assert comparison["tokens_per_s"]["fresh"] > 0 and 0 <= comparison["acceptance_rate"]["fresh"] <= 1
    from onlinespec.online.buffer import ReplayBuffer  # the draft born from nothing learns from the compared requests (an
    assert len(ReplayBuffer(tmp_path / "run" / "buffer" / "fresh")) > 0  # update of it may not run in 7: one at a time)
    report = (tmp_path / "run" / "report.md").read_text()
    bad = runner.invoke(app, ["demo", "--per-domain", "3,2", "--out-dir", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "--per-domain" in bad.output
    assert "target alone" in report and "fresh draft" in report and (tmp_path / "run" / "alpha.png").stat().st_size > 0


def test_bench_at_several_concurrency_levels(tmp_path, tiny_target_folder):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x): return x + x + x + x", "domain": "code"}) + "\n" for i in range(5)))
    out = tmp_path / "conc.json"
    result = runner.invoke(app, ["bench", "--prompts", str(prompts), "--json", str(out), "--target", str(tiny_target_folder),
                                 "--draft", "ngram", "--k", "3", "--max-new-tokens", "6", "--concurrency", "1,3", "--no-kernels"])
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert set(summary["concurrency"]) == {"1", "3"}
    for level in summary["concurrency"].values():
        for method in ("target_alone", "speculative"):
            fig = level[method]
            for key in ("tokens_per_s", "requests_per_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s"):
                assert fig[key] > 0, key
            assert fig["greedy_identical"] == 5 and fig["new_tokens"] <= 5 * 6
        assert level["speedup_vs_target"] > 0 and level["predicted_speedup"] > 0
    assert summary["concurrency"]["3"]["target_alone"]["mean_batch"] > 1  # requests really ran together
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_refuses_a_bad_concurrency_list(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n')
    result = runner.invoke(app, ["bench", "--prompts", str(prompts), "--json", str(tmp_path / "o.json"), "--concurrency", "1,zero"])
    assert result.exit_code == 2
    assert "comma-separated whole numbers" in result.output
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize(("option", "says"), [
    (["--loss", "bogus"], "unknown distillation loss 'bogus': use one of fkl, rkl, jsd, tvd"),
    (["--lr", "-0.001"], "the learning rate must be a positive number"),
    (["--retention-days", "0"], "retention_days must be > 0"),
])
def test_online_refuses_bad_learner_options_before_loading_anything(tmp_path, option, says):
    stream = tmp_path / "s.jsonl"
    stream.write_text('{"prompt": "fine"}\n')
    result = runner.invoke(app, ["online", "--stream", str(stream), "--json", str(tmp_path / "o.json"), "--out-dir",
                                 str(tmp_path / "run"), *option])
    assert result.exit_code == 2 and says in " ".join(result.output.split())
    assert not (tmp_path / "run").exists()


def test_a_failing_request_is_an_error_row_and_the_run_still_reports(tmp_path, tiny_target_folder):
    """A prompt longer than the tiny target's 256-token context fails alone; the rest is served,
    learnt from and reported, with the governance of the training data; then its records can be purged."""
    stream = tmp_path / "s.jsonl"
    lines = [{"id": f"q{i}", "prompt": f"def f{i}(x):", "domain": "code", "category": "python"} for i in range(4)]
    lines.insert(2, {"id": "too-long", "prompt": "word " * 400, "domain": "code"})
    lines.append({"id": "private", "prompt": "def secret(x):", "domain": "code", "train": False})
    stream.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out, run = tmp_path / "o.json", tmp_path / "run"
    result = runner.invoke(app, ["online", "--stream", str(stream), "--json", str(out), "--out-dir", str(run), "--target",
                                 str(tiny_target_folder), "--draft", "target-layers:1", "--k", "2", "--max-new-tokens", "6",
                                 "--update-interval", "2", "--steps-per-update", "2", "--no-kernels", "--fixed-k", "--priority", "normal"])
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())
    assert results["summary"]["n_errors"] == 1 and results["summary"]["n_requests"] == 5
    assert results["errors"][0]["id"] == "too-long" and "context" in results["errors"][0]["error"]
    governance = results["governance"]
    assert governance["records_stored"] == 4 and governance["refused_opt_out"] == 1 and governance["write_failures"] == 0
    report = (run / "report.md").read_text()
    assert "1 requests failed" in report and "Training data" in report
    purged = runner.invoke(app, ["data", "purge", "--out-dir", str(run), "--request-id", "q1"])
    assert purged.exit_code == 0 and "deleted 1 records" in purged.output
    from onlinespec.online.buffer import ReplayBuffer

    assert sorted(r.request_id for r in ReplayBuffer(run / "buffer" / "code").records()) == ["q0", "q2", "q3"]


def test_data_purge_refuses_a_folder_a_server_holds(tmp_path):
    from onlinespec.storage import OutDirLock

    with OutDirLock(tmp_path):
        result = runner.invoke(app, ["data", "purge", "--out-dir", str(tmp_path), "--older-than-days", "30"])
    assert result.exit_code == 2 and "in use by another process" in " ".join(result.output.split())
    result = runner.invoke(app, ["data", "purge", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "exactly one of" in result.output


def test_serve_with_replicas_refuses_content_routing_before_starting_anything(tmp_path):
    result = runner.invoke(app, ["serve", "--replicas", "2", "--router", "content", "--out-dir", str(tmp_path / "run")])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "single process" in said and "--router domain" in said
    assert not (tmp_path / "run").exists()


def test_serve_takes_vllms_flag_names_beside_ours(tmp_path, monkeypatch):
    """`onlinespec serve MODEL --max-num-seqs --max-model-len --dtype --served-model-name a,b
    --log-level`: parsed into the settings the server gets (nothing starts); bad values exit 2."""
    from onlinespec import cli
    from onlinespec.serve import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda make_core, host, port, settings, logs: seen.update(
        core=make_core.args[0], settings=settings, logs=logs))
    monkeypatch.setattr(cli.serving, "private_files", lambda: None)
    out = ["--out-dir", str(tmp_path / "run")]
    result = runner.invoke(app, ["serve", "models/tiny", "--max-num-seqs", "3", "--max-model-len", "128", "--dtype", "bfloat16",
                                 "--backend", "torch", "--served-model-name", "a,b", "--served-model-name", "c", "--log-level", "debug",
                                 "--log-format", "text", *out])
    assert result.exit_code == 0, result.output
    core, settings = seen["core"], seen["settings"]
    assert (core.target, core.max_batch, core.max_model_len, core.dtype, core.model_name) == ("models/tiny", 3, 128, "bfloat16", "a")
    assert settings.model_name == "a" and settings.names == ("a", "b", "c")
    assert (seen["logs"].level, seen["logs"].format) == ("debug", "text")
    result = runner.invoke(app, ["serve", "--model", "models/other", "--max-batch", "2", "--dtype", "half", "--backend", "torch", *out])
    assert result.exit_code == 0, result.output
    assert (seen["core"].target, seen["core"].max_batch, seen["core"].dtype, seen["settings"].names) == ("models/other", 2, "float16", ("other",))
    for args, said in ((["m1", "--target", "m2"], "disagree"),
                       (["--dtype", "float16", "--backend", "llama.cpp", "--device", "cpu"], "quantisation decides"),
                       (["--dtype", "float8"], "use auto, float32, float16 or bfloat16"),
                       (["--log-level", "loud"], "--log-level"), (["--log-format", "xml"], "--log-format")):
        result = runner.invoke(app, ["serve", *args, *out])
        assert result.exit_code == 2 and said in " ".join(result.output.split()), (args, result.output)
