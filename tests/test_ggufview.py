"""The llama.cpp backend's torch side read from the GGUF alone (onlinespec.ggufview): on the packaged
default, the same tokenizer, config and embedding rows as the whole model loaded in PyTorch, and a
head born from it identical to one born from the torch model; no decoder layer is loaded."""

import pytest
import torch

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def view():
    from onlinespec.ggufview import load_gguf_view
    from onlinespec.models import default_gguf_path

    return load_gguf_view(default_gguf_path())


def test_the_view_reads_what_the_torch_load_reads(view, default_target):
    model, tokenizer = view
    torch_model, torch_tokenizer = default_target.model, default_target.tokenizer
    chat = [{"role": "user", "content": "Write a function that reverses a list."}]
    assert tokenizer("def f(x):\n    return x[::-1]").input_ids == torch_tokenizer("def f(x):\n    return x[::-1]").input_ids
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == torch_tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    for key in ("hidden_size", "vocab_size", "num_hidden_layers", "tie_word_embeddings"):
        assert getattr(model.config, key) == getattr(torch_model.config, key)
    assert model.generation_config.eos_token_id == torch_model.generation_config.eos_token_id
    ids = torch.tensor([[0, 1, 17], [4000, 49151, 17]])
    assert torch.equal(model.embedding[ids], torch_model.get_input_embeddings().weight[ids])
    assert torch.equal(model.output[ids[0]], torch_model.get_output_embeddings().weight[ids[0]])
    assert sum(p.numel() for p in model.parameters()) == 0  # no decoder, no tables in torch: rows are read when asked
    with pytest.raises(RuntimeError, match="--backend torch"):
        model(torch.tensor([[1]]))


def test_a_head_born_from_the_view_is_the_one_born_from_the_torch_model(view, default_target):
    from onlinespec.decoding.feature_head import FeatureHead

    eos = [default_target.tokenizer.eos_token_id]
    torch.manual_seed(0)
    from_view = FeatureHead.fresh(view[0], eos, vocab_size=64)
    torch.manual_seed(0)
    from_torch = FeatureHead.fresh(default_target.model, eos, vocab_size=64)
    assert torch.equal(from_view.out_rows, from_torch.out_rows)
    feature, tokens = torch.randn(2, from_view.config.hidden_size), torch.tensor([5, 300])
    assert torch.equal(from_view.logits(from_view.step(feature, tokens)), from_torch.logits(from_torch.step(feature, tokens)))
    copy = from_view.clone()
    assert copy.embedding is from_view.embedding  # a trainable copy shares the rows, never copies them


def test_rows_first_read_in_inference_mode_can_be_read_by_a_learner_outside_it():
    """The engine drafts in inference mode, the learner trains outside it, and a fresh head on a
    GGUF target reads the same tables: on the 1.5B target every update failed ("Inplace update to
    inference tensor outside InferenceMode") once the engine had read a row first."""
    from onlinespec.ggufview import load_gguf_view
    from onlinespec.models import default_gguf_path

    model, _ = load_gguf_view(default_gguf_path())  # a view of its own: its row cache starts empty
    with torch.inference_mode():
        served = model.embedding[torch.tensor([5, 300])]
    learned = model.embedding[torch.tensor([5, 301, 4000])]  # new rows, read where training runs
    assert torch.equal(learned[0], served[0]) and not learned.is_inference()
