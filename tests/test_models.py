"""Loading targets and drafts: the packaged default, local folders, truncated-target drafts, and the
clear errors a user gets for a bad spec or a draft with another tokenizer.

Tests marked ``slow`` load the real default target (SmolLM2-135M-Instruct, ~5 s from the cache);
the rest build tiny models and WordLevel tokenizers in ``tmp_path``.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from onlinespec.decoding.autoregressive import autoregressive_decoder
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.models import (
    LoadedModel,
    TokenizerMismatchError,
    check_same_tokenizer,
    load_draft,
    load_model,
    tokenizer_fingerprint,
)

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = {"<unk>": 0, "<eos>": 1, "a": 2, "b": 3, "c": 4, "d": 5}


def word_tokenizer(vocab: dict[str, int] = WORDS, eos: str = "<eos>") -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(dict(vocab), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token="<unk>")


def save_tiny_model(folder, tokenizer, n_layers: int = 1, seed: int = 0) -> str:
    """A tiny Llama + tokenizer saved as a Hugging Face folder (config.json, safetensors, tokenizer)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer.get_vocab()),
        hidden_size=16,
        num_hidden_layers=n_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=32,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def swapped(vocab: dict[str, int], a: str, b: str) -> dict[str, int]:
    out = dict(vocab)
    out[a], out[b] = vocab[b], vocab[a]
    return out


# ---- local folders and tokenizer checks (fast) -------------------------------------------------------


def test_load_model_from_a_local_folder(tmp_path):
    path = save_tiny_model(tmp_path / "m", word_tokenizer(), n_layers=2)
    loaded = load_model(path)
    assert isinstance(loaded, LoadedModel) and loaded.name == path
    assert isinstance(loaded.model, LlamaForCausalLM) and loaded.model.config.num_hidden_layers == 2
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.dtype == torch.float32
    assert loaded.tokenizer("a b c").input_ids == [2, 3, 4]
    assert load_model(path, dtype="bfloat16").model.dtype == torch.bfloat16


def test_unknown_dtype_is_a_clear_error(tmp_path):
    path = save_tiny_model(tmp_path / "m", word_tokenizer())
    with pytest.raises(ValueError, match="unknown dtype 'float8'.*bfloat16.*float32"):
        load_model(path, dtype="float8")


def test_draft_with_the_same_tokenizer_loads(tmp_path):
    target = load_model(save_tiny_model(tmp_path / "t", word_tokenizer(), seed=0))
    draft = load_draft(save_tiny_model(tmp_path / "d", word_tokenizer(), seed=1), target)
    assert isinstance(draft.model, LlamaForCausalLM)
    assert tokenizer_fingerprint(draft.tokenizer) == tokenizer_fingerprint(target.tokenizer)


@pytest.mark.parametrize(
    "draft_vocab, draft_eos, message",
    [
        # either swapped token may be named (the vocabulary's iteration order is not fixed)
        (swapped(WORDS, "b", "c"), "<eos>", r"token '(b' has id 3 in the target but 4|c' has id 4 in the target but 3) in the draft"),
        ({**WORDS, "e": 6}, "<eos>", r"vocabulary sizes differ \(6 vs 7\)"),
        (WORDS, "d", r"EOS ids differ \(1 vs 5\)"),
    ],
    ids=["swapped-ids", "extra-token", "other-eos"],
)
def test_draft_with_another_tokenizer_is_refused(tmp_path, draft_vocab, draft_eos, message):
    target = load_model(save_tiny_model(tmp_path / "target", word_tokenizer()))
    draft_path = save_tiny_model(tmp_path / "draft", word_tokenizer(draft_vocab, eos=draft_eos))
    with pytest.raises(TokenizerMismatchError, match=message) as excinfo:
        load_draft(draft_path, target)
    text = str(excinfo.value)
    assert repr(draft_path) in text and repr(target.name) in text
    assert "the target's tokenizer" in text
    assert isinstance(excinfo.value, ValueError)  # callers catching ValueError still catch it
    assert tokenizer_fingerprint(word_tokenizer(draft_vocab, eos=draft_eos)) != tokenizer_fingerprint(target.tokenizer)


def test_check_same_tokenizer_accepts_equal_tokenizers():
    check_same_tokenizer(word_tokenizer(), word_tokenizer())


@pytest.mark.parametrize("load", [load_model, lambda spec: load_draft(spec, None)], ids=["load_model", "load_draft"])
def test_missing_model_path_names_the_accepted_specs(tmp_path, load):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError) as excinfo:
        load(missing)
    text = str(excinfo.value)
    assert repr(missing) in text
    for form in ("'default'", "Hugging Face folder", ".gguf", "'target-layers:N'"):
        assert form in text, (form, text)


def test_folder_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path / "empty"))


# ---- truncated-target drafts on a tiny 4-layer target (fast) --------------------------------------------


@pytest.fixture
def tiny_four_layer(tmp_path):
    return load_model(save_tiny_model(tmp_path / "t4", word_tokenizer(), n_layers=4))


def test_truncated_draft_shares_the_targets_weights(tiny_four_layer):
    target = tiny_four_layer
    draft = load_draft("target-layers:2", target)
    assert draft.tokenizer is target.tokenizer and draft.name == "target-layers:2"
    _assert_shared_truncation(draft.model, target.model, 2)
    assert target.model.config.num_hidden_layers == 4 and len(target.model.model.layers) == 4
    for n in (1, 2, 3):
        _assert_draft_is_early_exit(load_draft(f"target-layers:{n}", target).model, target.model, n, [2, 3, 4, 5, 1, 2])


@pytest.mark.parametrize("n", [0, 4, 99, -1])
def test_truncated_draft_layer_count_out_of_range(tiny_four_layer, n):
    with pytest.raises(ValueError, match=r"target-layers:N needs 1 <= N < 4 \(the target's layer count\)"):
        load_draft(f"target-layers:{n}", tiny_four_layer)


@pytest.mark.parametrize("spec", ["target-layers:x", "target-layers:", "target-layers:2.5"])
def test_truncated_draft_spec_must_be_an_integer(tiny_four_layer, spec):
    with pytest.raises(ValueError, match=f"bad draft spec {spec!r}: expected 'target-layers:N' with N an integer"):
        load_draft(spec, tiny_four_layer)


def test_truncated_draft_decodes_losslessly(tiny_four_layer):
    """The truncated draft runs with its own (shorter) KV cache; greedy output equals the target's."""
    target = tiny_four_layer.model
    draft = load_draft("target-layers:1", tiny_four_layer).model
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for prompt in ([2, 3], [5, 4, 3, 2]):
        expected = autoregressive_decoder(target).generate(prompt, params).token_ids
        out = SpeculativeDecoder(target, None, DraftModelProposer(draft), k=3).generate(prompt, params)
        assert out.token_ids == expected


@torch.no_grad()
def _assert_draft_is_early_exit(draft, target, n_layers: int, ids: list[int]) -> None:
    """The draft's logits are the target's head applied to its normed hidden state after n layers."""
    ids = torch.tensor([ids])
    hidden = target(input_ids=ids, output_hidden_states=True).hidden_states[n_layers]
    expected = target.lm_head(target.model.norm(hidden))
    torch.testing.assert_close(draft(input_ids=ids).logits, expected)


def _assert_shared_truncation(draft, target, n_layers: int) -> None:
    assert draft.config.num_hidden_layers == n_layers and len(draft.model.layers) == n_layers
    assert draft.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert draft.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert draft.model.norm.weight.data_ptr() == target.model.norm.weight.data_ptr()
    for mine, theirs in zip(draft.model.layers, target.model.layers[:n_layers]):
        assert mine is theirs
        for a, b in zip(mine.parameters(), theirs.parameters()):
            assert a.data_ptr() == b.data_ptr()
    assert not any(p.is_meta for p in draft.parameters()), "a draft weight was left on the meta device"
    assert not draft.training


# ---- the real default target (slow) -------------------------------------------------------------------


@pytest.mark.slow
def test_default_target_is_smollm2(default_target):
    model = default_target.model
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.num_hidden_layers == 30 and len(model.model.layers) == 30
    assert model.config.vocab_size == 49152 and len(default_target.tokenizer) == 49152
    assert model.dtype == torch.float32 and not model.training
    assert default_target.name == "SmolLM2-135M-Instruct"
    out = autoregressive_decoder(model, default_target.tokenizer).generate(
        "The capital of France is", SamplingParams(max_new_tokens=4)
    )
    assert "Paris" in out.text


@pytest.mark.slow
def test_default_truncated_draft_shares_weights_and_is_lossless(default_target):
    draft = load_draft("target-layers:2", default_target)
    _assert_shared_truncation(draft.model, default_target.model, 2)
    params = SamplingParams(max_new_tokens=16)
    prompt = [{"role": "user", "content": "List three colors."}]
    expected = autoregressive_decoder(default_target.model, default_target.tokenizer).generate(prompt, params)
    decoder = SpeculativeDecoder(default_target.model, default_target.tokenizer, DraftModelProposer(draft.model), k=3)
    out = decoder.generate(prompt, params)
    assert (out.token_ids, out.text) == (expected.token_ids, expected.text)
    assert out.stats.proposed > 0
    _assert_draft_is_early_exit(draft.model, default_target.model, 2, out.prompt_ids + out.token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("spec, message", [("target-layers:99", "1 <= N < 30"), ("target-layers:x", "N an integer")])
def test_default_truncated_draft_bad_specs(default_target, spec, message):
    with pytest.raises(ValueError, match=message):
        load_draft(spec, default_target)


@pytest.mark.slow
def test_default_target_refuses_a_draft_with_another_tokenizer(default_target, tmp_path):
    draft_path = save_tiny_model(tmp_path / "words", word_tokenizer())
    with pytest.raises(TokenizerMismatchError, match=r"vocabulary sizes differ \(49152 vs 6\)"):
        load_draft(draft_path, default_target)
