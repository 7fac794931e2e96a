"""Specialise a head on one domain with one training signal and one loss (a cell of Table 1).

The paper's Table 1 fine-tunes a general draft on each domain's data and compares the training
signals (teacher / student / mixed sampling, a fixed data set) and losses (FKL, RKL, JSD, TVD),
plus plain fine-tuning on ground-truth text. Here:

- ``teacher`` / ``student`` / ``mixed``: :mod:`onlinespec.distill.signal` on the domain's
  warm-up queries (the student is the starting head itself, sampled once before training);
- ``fixed``: the queries' real text, teacher-forced, with the target's distributions;
- ``ground-truth``: the same real text with one-hot labels (the next real token): fine-tuning
  without the teacher.

Every run is scored on the held-out prompts' greedy target outputs, per domain.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from onlinespec.data.sources import Query
from onlinespec.decoding.feature_head import CHAIN_DEPTH, WEIGHTS_FILE, FeatureHead
from onlinespec.distill.losses import LOSSES
from onlinespec.distill.signal import Signal, SignalConfig, build_signal
from onlinespec.drafts.train import ChainConfig, ChainTask, evaluate_chain
from onlinespec.drafts.warmup import heldout_signal, signal_key, warmup_queries
from onlinespec.models import LoadedModel

SIGNALS = ("teacher", "student", "mixed", "fixed", "ground-truth")


@dataclass(frozen=True)
class DistillRun:
    domain: str
    signal: str = "teacher"
    loss: str = "fkl"
    queries: int = 200
    offset: int = 0  # skip the domain's first warm-up queries (e.g. the ones the start head saw)
    steps: int = 300
    batch_size: int = 256
    lr: float = 3e-4
    mix_ratio: float = 0.5
    max_new_tokens: int = 128
    depth: int = CHAIN_DEPTH
    seed: int = 0

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ValueError(f"unknown signal {self.signal!r}: use one of {SIGNALS}")
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}: use one of {LOSSES}")
        if self.domain not in ("chat", "code", "math"):
            raise ValueError(f"unknown domain {self.domain!r}: use chat, code or math")


def domain_queries(domain: str, n: int, offset: int = 0) -> list[Query]:
    """The domain's warm-up queries (maths: English plus the other languages' warm-up templates)."""
    greedy, _, extra = warmup_queries()
    pool = [q for q in greedy + extra if q.domain == domain or (domain == "math" and q.domain.startswith("math"))]
    random.Random(f"specialise:{domain}").shuffle(pool)
    picked = pool[offset: offset + n]
    if not picked:
        raise ValueError(f"no {domain} warm-up queries left after the first {offset}")
    return picked


def run_signal(target: LoadedModel, head: FeatureHead, head_tag: str, run: DistillRun, progress: bool = True) -> Signal:
    queries = domain_queries(run.domain, run.queries, run.offset)
    sampling = {"ground-truth": "fixed"}.get(run.signal, run.signal)
    config = SignalConfig(sampling=sampling, max_new_tokens=run.max_new_tokens, mix_ratio=run.mix_ratio, batch_size=48, seed=run.seed)
    return build_signal(target.model, target.tokenizer, queries, config, student=head, cache_as=signal_key(target), student_tag=head_tag, progress=progress)


def one_hot(signal: Signal) -> Signal:
    """The same text with the real next token as the teacher (probability 1): ground truth."""
    nxt = torch.cat([signal.ids[1:], signal.ids[-1:]])
    return dataclasses.replace(signal, top_ids=nxt[:, None], top_logprobs=torch.zeros(len(nxt), 1))


def run_distill(target: LoadedModel, start: str | Path, run: DistillRun, out_dir: str | Path | None = None, progress: bool = True) -> dict:
    from onlinespec.distill.step import DistillConfig
    from onlinespec.distill.trainer import TrainConfig, Trainer
    from onlinespec.drafts.heads import load_head

    head = load_head(start, target)
    tag = hashlib.sha256((Path(start) / WEIGHTS_FILE).read_bytes()).hexdigest()[:16]
    heldout = heldout_signal(target, progress=progress)
    before = evaluate_chain(head, heldout, depth=run.depth)
    signal = run_signal(target, head, tag, run, progress)
    if run.signal == "ground-truth":
        signal = one_hot(signal)
    task = ChainTask(signal, ChainConfig(depth=run.depth))
    config = TrainConfig(
        steps=run.steps, batch_size=run.batch_size, lr=run.lr, warmup_steps=min(50, run.steps // 5),
        checkpoint_every=10**9, seed=run.seed, distill=DistillConfig(loss=run.loss),
    )
    with tempfile.TemporaryDirectory() as work:
        trainer = Trainer(head, task.starts.tolist(), work, config, step_fn=task.step)
        trainer.run(progress=progress)
    after = evaluate_chain(head, heldout, depth=run.depth)
    result = {
        "run": dataclasses.asdict(run), "start": str(start), "tokens": signal.n_tokens,
        "final_loss": trainer.losses[-1], "before": before, "heldout": after,
    }
    if out_dir is not None:
        head.save(out_dir, {**FeatureHead.info(start), "specialised": result})
    return result
