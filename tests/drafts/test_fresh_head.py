"""A draft for any target, from nothing: a target with no packaged head (here another
architecture and another tokenizer than the default's, built in the test) is served at once with
a fresh head born from its own embeddings and output layer, whose vocabulary follows the served
text, and the server learns from the first requests, losslessly. Tiny random models: mechanics."""

from __future__ import annotations

import pytest
import torch

from onlinespec.decoding.feature_head import FeatureHead, frequent_vocab
from onlinespec.online.learnable import learnable
from onlinespec.weights import load_weights

TEXTS = ["def add(a, b):\n    return a + b\n", "The cat sat on the mat. The dog sat on the log.",
         "SELECT name FROM users WHERE id = 1;", "Two plus two is four. Three plus three is six."] * 20
CHAT = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


@pytest.fixture(scope="module")
def other_target(tmp_path_factory):
    """A tiny random Qwen2 with a byte-level BPE tokenizer of its own (288 tokens), as a folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=288, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", chat_template=CHAT)
    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaked next-token distributions: greedy decoding far from ties
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    folder = tmp_path_factory.mktemp("qwen2-own-tokenizer")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_frequent_vocab_keeps_its_size_the_ids_it_must_and_the_most_used():
    counts = torch.zeros(20)
    counts[[7, 3, 15]] = torch.tensor([5.0, 9.0, 1.0])
    assert frequent_vocab(counts, 5, [19]).tolist() == [0, 3, 7, 15, 19]  # then unseen ids, lowest first
    assert frequent_vocab(torch.zeros(20), 4, [2]).tolist() == [0, 1, 2, 3]


def test_a_fresh_head_chooses_its_vocabulary_from_served_text_and_reloads_it(tiny_llama, tmp_path):
    target = tiny_llama(seed=0, vocab_size=64, hidden_size=16)
    head = FeatureHead.fresh(target, eos_ids=[63], vocab_size=8)
    assert head.vocab_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 63]
    from onlinespec.distill.records import DistillRecord

    record = DistillRecord([40, 41, 40, 42, 40, 41], [1, 2], torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1), 2)
    copy = head.clone()
    assert learnable(copy).cold(copy)  # trained at the warm-up's learning rate (LearnerConfig.cold_lr)
    learnable(copy).adapt(copy, [record])
    assert head.vocab_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 63]  # the serving head is never touched
    assert {40, 41, 42, 63} <= set(copy.vocab_ids.tolist()) and len(copy.vocab_ids) == 8
    assert torch.equal(copy.out_rows, target.get_output_embeddings().weight[copy.vocab_ids])
    # a published version loads into the serving head's shape with its own vocabulary (the registry's load)
    load_weights(head, copy.state_dict())
    assert torch.equal(head.vocab_ids, copy.vocab_ids) and torch.equal(head.out_rows, copy.out_rows)
    assert head.restricted_index[41] >= 0 and head.restricted_index[10] == -1
    copy.save(tmp_path / "h")
    again = FeatureHead.load(tmp_path / "h", target)
    assert torch.equal(again.vocab_ids, copy.vocab_ids) and again.config.vocab_from_traffic and again.config.keep_ids == [63]


def test_a_head_born_from_a_wide_target_is_narrower_passes_the_feature_through_and_reloads(tiny_llama, tmp_path, monkeypatch):
    import onlinespec.decoding.feature_head as fh

    target = tiny_llama(seed=0, vocab_size=64, hidden_size=16)
    monkeypatch.setattr(fh, "NARROW_FROM", 8)  # a 1.5B's 1,536 is wide; a 16-wide tiny model stands in for it
    monkeypatch.setattr(fh, "NARROW_WIDTH", 4)
    head = FeatureHead.fresh(target, eos_ids=[63], vocab_size=8)
    assert head.config.width == 4 and head.fuse.weight.shape == (4, 32) and head.up.weight.shape == (16, 4)
    assert head.blocks[0].gate_up.weight.shape[1] == 4
    feature = torch.randn(3, 16)
    with torch.no_grad():  # at birth the body adds nothing: the head proposes from the feature it read
        assert torch.allclose(head.step(feature, torch.tensor([1, 2, 3])), head.out_norm(feature))
        head.up.weight.normal_()
    head.save(tmp_path / "narrow")
    again = FeatureHead.load(tmp_path / "narrow", target)
    tokens = torch.tensor([1, 2, 3])
    assert again.config.width == 4 and torch.equal(again.step(feature, tokens), head.step(feature, tokens))


def test_any_target_is_served_at_once_learns_and_stays_lossless(other_target, tmp_path, monkeypatch):
    from onlinespec.data import Query
    from onlinespec.factory import load_decoder
    from onlinespec.online.learner import LearnerConfig
    from onlinespec.serve.config import CoreConfig
    from onlinespec.stream import OnlineConfig, run_stream

    monkeypatch.setenv("ONLINESPEC_CACHE", str(tmp_path / "cache"))
    decoder = load_decoder(str(other_target), draft="hybrid", calibrate=False)  # no packaged head fits: a fresh one
    assert decoder.proposer.learned.head.config.vocab_from_traffic
    queries = [Query(id=f"q{i}", domain="code", origin="test", prompt=TEXTS[i % 4][:20]) for i in range(8)]
    core = CoreConfig(target=str(other_target), draft="hybrid", k=3, kernels=False, adaptive_k=False,
                      learner=LearnerConfig(update_interval=2, steps_per_update=4, batch_size=4, priority="normal", gate_margin=1.0))
    result = run_stream(queries, OnlineConfig(core, max_new_tokens=12, compare_every=2, fresh=True), tmp_path / "run")
    assert result["summary"]["n_errors"] == 0
    comparison = result["comparison"]
    assert comparison["n_requests"] == 4 and comparison["identical"] == 4  # online, static, fresh and target alone: token for token
    assert "fresh" in comparison["acceptance_rate"] and any(u["draft"] == "fresh" for u in result["updates"])
    published = [u for u in result["updates"] if u["version"] and u["draft"] == "code"]
    assert published, result["updates"]
    learning = result["learner"]["learning"]  # the updates ran in the engine's turns, and say what they took
    assert 0 < learning["share_limit"] <= 0.1 and learning["turns"] > 0 and learning["engine_seconds"] > 0  # the controller may back off
    assert all(u["engine_seconds"] > 0 for u in published)
    assert {(u["steps"], u["cold"]) for u in result["updates"] if u["version"]} == {(4 * 4, True)}  # a cold head: cold_steps times the steps
    assert {u["gate_metric"] for u in result["updates"] if u["draft"] == "code"} == {"alpha"}  # and judged by alpha (gate_metric 'auto')
    from onlinespec.online.registry import DraftRegistry

    assert DraftRegistry(tmp_path / "run" / "drafts" / "code").current() == published[-1]["version"]


def test_a_fresh_baseline_needs_a_learning_head_draft_outside_content_routing():
    from onlinespec.serve.config import CoreConfig
    from onlinespec.stream import OnlineConfig

    assert CoreConfig(fresh_baseline=True).fresh_draft == "hybrid:fresh"
    for options in ({"draft": "ngram"}, {"router": "content"}, {"learn": False}):
        with pytest.raises(ValueError, match="needs --draft hybrid or head"):
            CoreConfig(fresh_baseline=True, **options)
    with pytest.raises(ValueError, match="give compare_every >= 1"):
        OnlineConfig(fresh=True)


def test_a_draft_a_server_published_is_served_by_naming_its_directory(other_target, tmp_path):
    """``--draft hybrid:<out-dir>/drafts/<name>``: the version the server serves (a benchmark of
    what it learned, or another server starting from it), in the head it started from."""
    from onlinespec.factory import fresh_head, make_proposer
    from onlinespec.models import load_model
    from onlinespec.online.registry import DraftRegistry

    target = load_model(str(other_target))
    learned = fresh_head(target)
    with torch.no_grad():
        learned.fuse.weight.add_(0.5)
    learned.choose_vocab(torch.arange(len(learned.vocab_ids)).flip(0))
    registry = DraftRegistry(tmp_path / "drafts" / "code")
    registry.publish({k: v for k, v in learned.state_dict().items()}, {"note": "test"})
    served = make_proposer(f"head:{registry.directory}", target).proposer.slot.model  # the float32 head it serves from
    assert torch.equal(served.fuse.weight, learned.fuse.weight) and torch.equal(served.vocab_ids, learned.vocab_ids)
