"""`onlinespec warmup` and `onlinespec distill` end to end on a tiny random target that uses the
real tokenizer (so the real warm-up queries go through): the head is built, saved with its
metadata, resumes, refuses a mismatched checkpoint, and drafts losslessly through `generate`."""

import json

from typer.testing import CliRunner

from onlinespec.cli import app

runner = CliRunner()
SMALL = ["--per-domain", "2", "--extra-chat", "0", "--extra-code", "0", "--math-languages", "", "--math-samples", "0",
         "--max-new-tokens", "4", "--batch-size", "32", "--vocab-size", "512", "--dtype", "float32"]


def test_warmup_builds_a_head_that_drafts_losslessly(tiny_target_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("ONLINESPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "head"
    result = runner.invoke(app, ["warmup", "--out", str(out), "--target", str(tiny_target_folder), "--steps", "6", *SMALL])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "warmup.json").read_text())
    assert meta["step"] == 6 and meta["recipe"]["vocab_size"] == 512 and meta["tokenizer"]
    assert set(meta["heldout"]) >= {"all", "chat", "code", "math"}
    assert "command" in meta  # the exact command line, for the record (sys.argv under a real shell)
    # the same settings resume (nothing left to do); other settings are refused, not mixed in
    again = runner.invoke(app, ["warmup", "--out", str(out), "--target", str(tiny_target_folder), "--steps", "6", *SMALL])
    assert again.exit_code == 0, again.output
    other = runner.invoke(app, ["warmup", "--out", str(out), "--target", str(tiny_target_folder), "--steps", "9", *SMALL])
    assert other.exit_code == 2 and "another warm-up" in other.output
    for draft in (f"head:{out}", f"hybrid:{out}", str(out)):
        gen = runner.invoke(app, ["generate", "def add(a, b):", "--raw", "--target", str(tiny_target_folder), "--draft", draft,
                                  "--max-new-tokens", "8", "--dtype", "float32"])
        plain = runner.invoke(app, ["generate", "def add(a, b):", "--raw", "--target", str(tiny_target_folder), "--draft", "none",
                                    "--max-new-tokens", "8", "--dtype", "float32"])
        assert gen.exit_code == 0 and gen.stdout == plain.stdout, (gen.output, plain.output)


def test_a_missing_head_is_a_clear_error(tiny_target_folder, tmp_path):
    result = runner.invoke(app, ["generate", "hi", "--target", str(tiny_target_folder), "--draft", f"head:{tmp_path}/nothing"])
    assert result.exit_code == 2 and "no feature head" in result.output
