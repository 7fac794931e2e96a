"""The command line as a user meets it: bench writes the promised figures; bad input is refused clearly."""

import json

import pytest
from typer.testing import CliRunner

from onlinespec.cli import app

runner = CliRunner()


@pytest.mark.slow
def test_bench_writes_side_by_side_figures(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}], "domain": "code"}\n'
        '{"prompt": "The capital of France is", "domain": "chat", "max_new_tokens": 6}\n'
    )
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "--prompts", str(prompts), "--json", str(out), "--draft", "ngram",
                                 "--k", "3", "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert summary["n_prompts"] == 2 and summary["k"] == 3 and summary["draft"] == "ngram"
    for key in ("speedup_vs_target", "speedup_vs_hf", "predicted_speedup"):
        assert summary[key] > 0
    assert summary["speculative"]["greedy_identical"] == 2
    for fig in (summary, *summary["domains"].values()):
        for method in ("target_alone", "speculative", "hf_assisted"):
            assert fig[method]["tokens_per_s"] > 0
        assert 0 <= fig["speculative"]["acceptance_rate"] <= 1
        assert fig["speculative"]["mean_accepted_length"] >= 1
    assert set(summary["domains"]) == {"code", "chat"}
    assert summary["prompts"][1]["new_tokens"]["target_alone"] <= 6  # the per-prompt max_new_tokens is honoured


def test_bench_reports_the_bad_line(tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"promt": "typo"}\n')
    result = runner.invoke(app, ["bench", "--prompts", str(prompts), "--json", str(tmp_path / "o.json")])
    assert result.exit_code == 2
    assert "bad.jsonl:2" in result.output
    assert not (tmp_path / "o.json").exists()


def test_generate_refuses_bad_sampling_settings():
    result = runner.invoke(app, ["generate", "hi", "--top-p", "1.5"])
    assert result.exit_code == 2
    assert "top_p" in result.output


def test_costmodel_prints_best_k():
    result = runner.invoke(app, ["costmodel", "--alpha", "0.6", "--c", "0.05", "--k-max", "10"])
    assert result.exit_code == 0
    assert "best k: 4" in result.output
