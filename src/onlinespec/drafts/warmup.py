"""The warm-up recipe: which queries a new draft learns from, and the signal built from them.

Only the ``warmup`` split is used (:func:`onlinespec.data.splits.split_of`), so the online
stream and the held-out evaluation never see a warm-up query. English maths has only 47 warm-up
problems, so maths also gets a few sampled continuations per problem and the same problems in
other languages (only templates whose English version is in the warm-up split: a translation of
a held-out problem would leak it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from onlinespec.data.sources import Query, english_pools, load_gsm_symbolic, packaged_prompts
from onlinespec.data.splits import split, split_of
from onlinespec.decoding.feature_head import CHAIN_DEPTH, HEAD_VOCAB, FeatureHead, frequent_vocab
from onlinespec.distill.signal import Signal, SignalConfig, build_signal
from onlinespec.distill.step import DistillConfig
from onlinespec.distill.trainer import TrainConfig, Trainer
from onlinespec.drafts.train import ChainConfig, ChainTask, evaluate_chain
from onlinespec.models import LoadedModel, cache_dir, tokenizer_fingerprint


@dataclass(frozen=True)
class WarmupData:
    per_domain: int = 600  # chat and code queries each
    extra_chat: int = 1200  # more chat (the hardest domain to draft), built as a separate cached part
    extra_code: int = 374  # the rest of the code warm-up pool
    math_languages: tuple[str, ...] = ("deu", "fra", "spa")
    math_samples: int = 3  # extra sampled continuations per English maths problem
    math_temperature: float = 0.7
    max_new_tokens: int = 128
    max_prompt_tokens: int = 256
    batch_size: int = 48
    seed: int = 0


@functools.lru_cache(maxsize=4)  # loading the pools parses all of ShareGPT: do it once per recipe
def warmup_queries(data: WarmupData = WarmupData()) -> tuple[list[Query], list[Query], list[Query]]:
    """(queries decoded greedily, maths queries decoded by sampling, extra chat and code queries
    decoded greedily), all from the warm-up split."""
    pools = english_pools(["chat", "code", "math"])
    greedy: list[Query] = []
    extra: list[Query] = []
    for domain, more in (("chat", data.extra_chat), ("code", data.extra_code)):
        pool = split(pools[domain], "warmup")
        random.Random(f"{data.seed}:{domain}").shuffle(pool)
        greedy += pool[: data.per_domain]
        extra += pool[data.per_domain: data.per_domain + more]
    math = split(pools["math"], "warmup")
    greedy += math
    for lang in data.math_languages:
        greedy += [q for q in load_gsm_symbolic(lang) if split_of(q.id.replace(f"/{lang}/", "/eng/")) == "warmup"]
    sampled = [replace(q, id=f"{q.id}#sample{i}") for i in range(data.math_samples) for q in math]
    return greedy, sampled, extra


def signal_key(target: LoadedModel) -> str:
    """How a target names its cached signals: the model and its dtype (their features differ)."""
    return f"{target.name}@{target.model.dtype}"


def warmup_signal(target: LoadedModel, data: WarmupData = WarmupData(), progress: bool = True) -> Signal:
    """The teacher-sampled warm-up signal (built once per target and recipe, then read from the cache)."""
    greedy, sampled, extra = warmup_queries(data)
    base = SignalConfig(
        sampling="teacher", max_new_tokens=data.max_new_tokens, max_prompt_tokens=data.max_prompt_tokens,
        batch_size=data.batch_size, seed=data.seed,
    )
    key = signal_key(target)
    parts = [build_signal(target.model, target.tokenizer, greedy, base, cache_as=key, progress=progress)]
    if sampled:
        hot = replace(base, temperature=data.math_temperature)
        parts.append(build_signal(target.model, target.tokenizer, sampled, hot, cache_as=key, progress=progress))
    if extra:
        parts.append(build_signal(target.model, target.tokenizer, extra, base, cache_as=key, progress=progress))
    return Signal.concat(parts)


def heldout_signal(target: LoadedModel, per_domain: int = 20, max_new_tokens: int = 64, progress: bool = True) -> Signal:
    """The target's greedy answers to held-out prompts (the bench's prompts), for evaluation."""
    queries = packaged_prompts(3 * per_domain, ("chat", "code", "math"), seed=0, split="heldout")
    config = SignalConfig(sampling="teacher", max_new_tokens=max_new_tokens, batch_size=30)
    return build_signal(target.model, target.tokenizer, queries, config, cache_as=signal_key(target), progress=progress)


@dataclass(frozen=True)
class HeadRecipe:
    vocab_size: int = HEAD_VOCAB
    intermediate_size: int = 1024
    num_blocks: int = 2
    depth: int = CHAIN_DEPTH
    step_decay: float = 0.8
    steps: int = 3000
    batch_size: int = 256
    lr: float = 1e-3
    warmup_steps: int = 100
    loss: str = "fkl"
    seed: int = 0


def warm_feature_head(
    target: LoadedModel,
    out: str,
    recipe: HeadRecipe = HeadRecipe(),
    data: WarmupData = WarmupData(),
    work_dir: str | None = None,
    progress: bool = True,
    until: int | None = None,
) -> dict:
    """Build (or resume building) a feature head for ``target`` and save it to folder ``out``.

    Checkpoints go to ``work_dir`` (default: the cache, ``warmup/<out folder name>``); run the
    same call again after a stop and training resumes where it was. Returns the metadata
    (with the held-out evaluation) written with the head.
    """
    signal = warmup_signal(target, data, progress)
    counts = torch.bincount(signal.ids, minlength=target.model.config.vocab_size)
    eos = target.tokenizer.eos_token_id
    vocab = frequent_vocab(counts, recipe.vocab_size, always=[eos] if eos is not None else [])
    torch.manual_seed(recipe.seed)
    head = FeatureHead.for_target(target.model, vocab, intermediate_size=recipe.intermediate_size, num_blocks=recipe.num_blocks)
    task = ChainTask(signal, ChainConfig(depth=recipe.depth, step_decay=recipe.step_decay))
    config = TrainConfig(
        steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr, warmup_steps=recipe.warmup_steps,
        checkpoint_every=250, seed=recipe.seed, distill=DistillConfig(loss=recipe.loss),
    )
    meta = {
        "target": target.name, "tokenizer": tokenizer_fingerprint(target.tokenizer), "dtype": str(target.model.dtype),
        "data": {**dataclasses.asdict(data), "tokens": signal.n_tokens, "sequences": len(signal)},
        "recipe": dataclasses.asdict(recipe),
    }
    work = Path(work_dir) if work_dir else cache_dir() / "warmup" / Path(out).name
    _check_resumable(work, meta)
    trainer = Trainer(head, task.starts.tolist(), work, config, metadata=meta, step_fn=task.step)
    trainer.run(progress=progress, until=until)
    evaluation = evaluate_chain(head, heldout_signal(target, progress=progress), depth=recipe.depth)
    meta.update(step=trainer.step, loss=trainer.losses[-1] if trainer.losses else None, heldout=evaluation)
    if trainer.step >= recipe.steps:
        head.save(out, meta)
    return meta


def _check_resumable(work, meta: dict) -> None:
    """Refuse to resume a checkpoint written for another recipe, data or target."""
    saved = work / "checkpoint" / "meta.json"
    if not saved.exists():
        return
    old = json.loads(saved.read_text())
    for key in ("target", "tokenizer", "dtype", "data", "recipe"):
        if old.get(key) != json.loads(json.dumps(meta.get(key))):  # as saved: tuples become lists
            raise ValueError(
                f"{work} holds a checkpoint of another warm-up ({key} differs): delete that folder to "
                "start over, or resume with the same settings"
            )
