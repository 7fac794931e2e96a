"""The bulk warm-up (``python -m onlinespec.drafts.bulk``): the GGUF loader, batched decoding and
scoring against one-request references, deadlines, and a whole smoke run on a tiny random target."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from onlinespec.decoding.feature_head import FeatureHead
from onlinespec.drafts import bulk

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": True,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def job(prompts, temperature=0.0, samples=1, new=6, name="chat"):
    return bulk.Job(name, temperature, samples, new, prompts, ["chat"] * len(prompts), [f"q{i}" for i in range(len(prompts))])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return bulk.build_target(CONFIG, None, "cpu")


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [30]]


def test_batched_decoding_equals_one_request_at_a_time(model):
    """Left-padded batches of uneven prompts give each prompt the target's own greedy answer."""
    out = bulk.decode(model, job(PROMPTS), [2], 2, token_budget=1 << 12, max_rows=3, deadline=float("inf"))
    assert sorted(p for _, p, _, _ in out) == sorted(len(p) for p in PROMPTS)
    for ids, prompt_len, domain, qid in out:
        alone = model.generate(torch.tensor([ids[:prompt_len]]), max_new_tokens=6, do_sample=False, pad_token_id=2, eos_token_id=[2])
        answer = alone[0, prompt_len:].tolist()
        stop = answer.index(2) + 1 if 2 in answer else len(answer)
        assert ids[prompt_len:] == answer[:stop], qid
        assert domain == "chat"


def test_sampled_jobs_make_every_sample_and_a_past_deadline_starts_nothing(model):
    torch.manual_seed(1)
    out = bulk.decode(model, job(PROMPTS, temperature=0.8, samples=3), [2], 2, 1 << 12, 8, float("inf"))
    assert sorted(q for *_, q in out) == sorted(f"q{i}#s{s}" for i in range(4) for s in range(3))
    assert bulk.decode(model, job(PROMPTS), [2], 2, 1 << 12, 8, deadline=0.0, log=lambda _: None) == []


def test_scoring_gives_the_targets_features_and_distributions(model):
    sequences = [([5, 6, 7, 8, 9], 2, "chat", "a"), ([12, 13, 14], 1, "code", "b")]
    signal = bulk.score(model, sequences, top_k=4, token_budget=6)  # two batches
    assert signal.n_tokens == 8 and signal.domains == ["chat", "code"] and signal.prompt_lens.tolist() == [2, 1]
    for i, (ids, *_rest) in enumerate(sequences):
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0]
            logprobs = torch.log_softmax(model.get_output_embeddings()(hidden), -1)
        rows = slice(int(signal.starts[i]), int(signal.starts[i + 1]))
        assert signal.ids[rows].tolist() == ids
        torch.testing.assert_close(signal.features[rows].float(), hidden, atol=2e-3, rtol=2e-3)
        top = logprobs.topk(4, -1)
        assert torch.equal(signal.top_ids[rows], top.indices)
        torch.testing.assert_close(signal.top_logprobs[rows], top.values, atol=1e-5, rtol=1e-5)


def write_bundle(path, version=bulk.BUNDLE_VERSION):
    jobs = [
        {"name": "chat", "temperature": 0.0, "samples": 1, "max_new_tokens": 8, "prompts": PROMPTS, "domains": ["chat"] * 4, "query_ids": list("abcd")},
        {"name": "code-sampled", "temperature": 0.8, "samples": 2, "max_new_tokens": 8, "prompts": PROMPTS[:2], "domains": ["code"] * 2, "query_ids": list("ef")},
    ]
    heldout = {"name": "heldout", "temperature": 0.0, "samples": 1, "max_new_tokens": 8, "prompts": [[40, 41, 42], [50, 51], [60]],
               "domains": ["chat", "code", "math"], "query_ids": list("xyz")}
    bundle = {"version": version, "target": "tiny", "tokenizer": "t", "config": CONFIG, "eos_ids": [2], "pad_id": 2, "jobs": jobs, "heldout": heldout}
    with gzip.open(path, "wt") as handle:
        json.dump(bundle, handle)
    return path


def test_smoke_run_saves_loadable_heads_with_their_evaluation(tmp_path):
    bundle = write_bundle(tmp_path / "bundle.json.gz")
    designs = (bulk.HeadDesign("small", 16, 1), bulk.HeadDesign("half", 24, 2, "float16"))
    recipe = bulk.BulkRecipe(vocab_size=48, batch_size=16, warmup_steps=5, max_steps=120)
    # smoke: 3 prompts a job, 2 samples at most
    summary = bulk.run(bundle, None, tmp_path / "out", seconds=30, designs=designs, recipe=recipe, device="cpu", smoke=True, log=lambda _: None)
    assert summary["decoded"]["chat"]["sequences"] == 3 and summary["decoded"]["code-sampled"]["sequences"] == 4
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["tokens"] == summary["tokens"] > 0
    torch.manual_seed(0)
    target = bulk.build_target(bulk.smoke_config(CONFIG), None, "cpu")
    for design in designs:
        folder = tmp_path / "out" / design.name
        head = FeatureHead.load(folder, target)
        assert head.fuse.weight.dtype == torch.float32 and len(head.blocks) == design.num_blocks
        info = FeatureHead.info(folder)
        assert info["train"]["steps"] <= recipe.max_steps and set(info["heldout"]) >= {"all", "chat", "code", "math"}
    assert (tmp_path / "out" / "tokens.npz").exists()


def test_a_bundle_of_another_version_is_refused(tmp_path):
    bundle = write_bundle(tmp_path / "old.json.gz", version=0)
    with pytest.raises(ValueError, match="export it again"):
        bulk.run(bundle, None, tmp_path / "out", smoke=True, device="cpu")


def test_run_without_gguf_says_what_to_give(tmp_path):
    with pytest.raises(ValueError, match="--gguf"):
        bulk.run(write_bundle(tmp_path / "b.json.gz"), None, tmp_path / "out", device="cpu")


@pytest.mark.slow
def test_gguf_loader_matches_the_converted_default_target():
    from onlinespec.models import default_gguf_path, default_target_dir, load_model

    config = json.loads((default_target_dir() / "config.json").read_text())
    state = bulk.llama_state_dict_from_gguf(default_gguf_path(), config)
    reference = load_model("default").model.state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                 "model.layers.7.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(state[name], reference[name]), name
    assert set(state) == {k for k in reference if k != "lm_head.weight"}
