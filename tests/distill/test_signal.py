"""Batched training-signal generation: what each sampling mode writes, and that it is what decoding sees."""

from __future__ import annotations

import pytest
import torch

from onlinespec.data.sources import Query
from onlinespec.decoding.feature_head import FeatureHead
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.distill.signal import Signal, SignalConfig, build_signal

pytestmark = pytest.mark.usefixtures("one_thread")

QUERIES = [
    Query("q/0", "chat", "test", prompt="Hello there, how are you today?"),
    Query("q/1", "code", "test", prompt="def add(a, b):"),
    Query("q/2", "math", "test", prompt="2 + 2 ="),
]


@pytest.fixture(scope="module")
def small(tiny_llama, default_tokenizer):
    """A random Llama with the real tokenizer's vocabulary (so prompts are real text)."""
    model = tiny_llama(5, vocab_size=len(default_tokenizer), hidden_size=16, head_scale=3.0)
    model.generation_config.eos_token_id = default_tokenizer.eos_token_id
    return model


def test_teacher_sequences_are_the_targets_greedy_outputs(small, default_tokenizer):
    config = SignalConfig(max_new_tokens=12, batch_size=2)  # 2 batches, left padding in each
    signal = build_signal(small, default_tokenizer, QUERIES, config, progress=False)
    plain = SpeculativeDecoder(small, default_tokenizer)
    for i, query in enumerate(QUERIES):
        ids = signal.ids[signal.starts[i]: signal.starts[i + 1]].tolist()
        prompt_len = int(signal.prompt_lens[i])
        assert ids[:prompt_len] == default_tokenizer(query.prompt).input_ids
        assert ids[prompt_len:] == plain.generate(query.prompt, SamplingParams(max_new_tokens=12)).token_ids
    # every row holds the target's state at that token: its argmax is the next greedy token
    generated = torch.cat([torch.arange(int(signal.starts[i] + signal.prompt_lens[i]) - 1, int(signal.starts[i + 1]) - 1) for i in range(3)])
    logits = small.get_output_embeddings()(signal.features[generated].float())
    assert torch.equal(logits.argmax(-1), signal.ids[generated + 1])
    assert torch.equal(signal.top_ids[generated, 0], signal.ids[generated + 1])
    assert signal.domains == ["chat", "code", "math"]


def test_fixed_signal_is_the_prompt_text_only(small, default_tokenizer):
    signal = build_signal(small, default_tokenizer, QUERIES, SignalConfig(sampling="fixed"), progress=False)
    assert signal.n_tokens == sum(len(default_tokenizer(q.prompt).input_ids) for q in QUERIES)
    assert torch.equal(signal.prompt_lens, signal.starts[1:] - signal.starts[:-1])


def test_student_and_mixed_sampling(small, default_tokenizer):
    with pytest.raises(ValueError, match="student"):
        build_signal(small, default_tokenizer, QUERIES, SignalConfig(sampling="student"), progress=False)
    torch.manual_seed(0)
    head = FeatureHead.for_target(small, torch.arange(0, 3000), intermediate_size=8, num_blocks=1)
    student = build_signal(small, default_tokenizer, QUERIES, SignalConfig(sampling="student", max_new_tokens=8), student=head, progress=False)
    # the student writes only tokens of its vocabulary; the target still scores every position
    for i in range(3):
        written = student.ids[int(student.starts[i] + student.prompt_lens[i]): int(student.starts[i + 1])]
        assert len(written) == 8 and bool((written < 3000).all())
    assert student.features.shape[0] == student.n_tokens
    teacher = build_signal(small, default_tokenizer, QUERIES, SignalConfig(max_new_tokens=8), progress=False)
    none_from_student = build_signal(
        small, default_tokenizer, QUERIES, SignalConfig(sampling="mixed", mix_ratio=0.0, max_new_tokens=8), student=head, progress=False
    )
    assert torch.equal(none_from_student.ids, teacher.ids)


def test_cache_round_trip_and_bad_config(small, default_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("ONLINESPEC_CACHE", str(tmp_path))
    config = SignalConfig(max_new_tokens=4)
    first = build_signal(small, default_tokenizer, QUERIES, config, cache_as="tiny", progress=False)
    assert list((tmp_path / "signals").glob("teacher-*.safetensors"))
    again = build_signal(small, default_tokenizer, QUERIES, config, cache_as="tiny", progress=False)
    assert torch.equal(first.ids, again.ids) and torch.equal(first.features, again.features)
    assert again.query_ids == ["q/0", "q/1", "q/2"]
    two = Signal.concat([first.select([2]), first.select([0])])
    assert two.domains == ["math", "chat"] and two.n_tokens == first.select([0, 2]).n_tokens
    with pytest.raises(ValueError, match="sampling mode"):
        SignalConfig(sampling="teachr")
