"""The trainer: its schedule, and a stopped-and-resumed run that equals an uninterrupted one."""

import json

import pytest
import torch

from onlinespec.distill.trainer import TrainConfig, Trainer
from onlinespec.distill.records import DistillRecord


def records(n=12, vocab=32):
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tokens = torch.randint(0, vocab, (10,), generator=gen).tolist()
        logits = torch.randn(4, vocab, generator=gen) * 3
        top = logits.log_softmax(-1).topk(5, dim=-1)
        out.append(DistillRecord(tokens, [3, 5, 7, 9], top.indices, top.values, prompt_len=3, request_id=str(i)))
    return out


def test_schedule_warms_up_then_decays():
    config = TrainConfig(steps=100, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert config.lr_at(0) == pytest.approx(1e-4)
    assert config.lr_at(9) == pytest.approx(1e-3)
    assert config.lr_at(55) < config.lr_at(10)
    assert config.lr_at(99) == pytest.approx(1e-4, rel=0.01)


def test_resume_reproduces_an_uninterrupted_run(tiny_llama, tmp_path):
    data = records()
    config = TrainConfig(steps=12, batch_size=4, lr=3e-3, warmup_steps=3, checkpoint_every=4)

    straight = tiny_llama(seed=7, vocab_size=32, hidden_size=32)
    losses = Trainer(straight, data, tmp_path / "a", config).run(progress=False)
    assert losses[-1] < losses[0]

    first = tiny_llama(seed=7, vocab_size=32, hidden_size=32)
    Trainer(first, data, tmp_path / "b", config).run(progress=False, until=5)  # stopped after step 5
    resumed_model = tiny_llama(seed=99, vocab_size=32, hidden_size=32)  # other weights: all must come from the checkpoint
    resumed = Trainer(resumed_model, data, tmp_path / "b", config)
    assert resumed.step == 5
    resumed.run(progress=False)
    for (name, a), b in zip(straight.state_dict().items(), resumed_model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    meta = json.loads((tmp_path / "b" / "checkpoint" / "meta.json").read_text())
    assert meta["step"] == 12 and len(meta["losses"]) == 12


def test_no_records_is_an_error(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="no training records"):
        Trainer(tiny_llama(seed=1), [], tmp_path, TrainConfig(steps=1))
