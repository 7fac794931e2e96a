"""Training signal for drafts: sequences with the target's features and distributions at every position.

Four sampling modes (arXiv 2310.07177, section 4.1; no gradient ever flows through the sampling):

- ``teacher``: the target's own continuations (greedy, or sampled at ``temperature``). This is
  exactly what the draft will be asked to predict when serving.
- ``student``: the draft writes the continuation; the target scores every position.
- ``mixed``: each token (or each whole request, ``mix_unit="request"``) comes from the student
  with probability ``mix_ratio``, else from the teacher.
- ``fixed``: teacher-forced real text (the prompts as they are), no generation.

Generation is batched (left-padded rows sharing one target forward per step, so the CPU runs
matrix-matrix products instead of matrix-vector ones). Every position ``t`` stores the target's
post-norm hidden state ``f_t`` and its top-K log-probabilities for the token at ``t + 1``: all a
feature head (or any draft) needs to distil, with no second pass. Results are cached on disk,
keyed by the target, the queries, the sampling mode and its settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, PreTrainedModel

from onlinespec.data.sources import Query
from onlinespec.decoding.batch_cache import cache_arg
from onlinespec.models import cache_dir
from onlinespec.tokens import encode_prompt, eos_token_ids

SAMPLING_MODES = ("teacher", "student", "mixed", "fixed")


@dataclass(frozen=True)
class SignalConfig:
    sampling: str = "teacher"
    max_new_tokens: int = 128
    max_prompt_tokens: int = 256  # longer prompts keep their last tokens
    temperature: float = 0.0  # 0: greedy (the target's own greedy outputs)
    mix_ratio: float = 0.5  # mixed: the chance a token (or request) comes from the student
    mix_unit: str = "token"  # token | request
    top_k: int = 32
    batch_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(f"unknown training-signal sampling mode {self.sampling!r}: use one of {SAMPLING_MODES}")
        if self.mix_unit not in ("token", "request"):
            raise ValueError(f"mix_unit must be 'token' or 'request', got {self.mix_unit!r}")
        if not 0.0 <= self.mix_ratio <= 1.0:
            raise ValueError(f"mix_ratio must lie in [0, 1], got {self.mix_ratio}")
        if self.max_new_tokens < 0 or self.max_prompt_tokens < 2 or self.batch_size < 1 or self.top_k < 1:
            raise ValueError("max_new_tokens >= 0, max_prompt_tokens >= 2, batch_size >= 1 and top_k >= 1 are required")


@dataclass
class Signal:
    """Sequences laid end to end. Sequence ``i`` spans ``starts[i]:starts[i+1]``; the first
    ``prompt_lens[i]`` of its tokens are the prompt. Row ``t`` of ``features`` / ``top_*`` is the
    target's state at token ``t`` and its distribution for token ``t + 1``."""

    ids: torch.Tensor  # [T] int64
    features: torch.Tensor  # [T, H] float16
    top_ids: torch.Tensor  # [T, K] int64
    top_logprobs: torch.Tensor  # [T, K] float32
    starts: torch.Tensor  # [S + 1] int64
    prompt_lens: torch.Tensor  # [S] int64
    domains: list[str]
    query_ids: list[str]

    def __len__(self) -> int:
        return len(self.domains)

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    def sequence_of(self) -> torch.Tensor:
        """[T]: the sequence index of every token."""
        lengths = self.starts[1:] - self.starts[:-1]
        return torch.repeat_interleave(torch.arange(len(self), device=lengths.device), lengths)

    def to(self, device: str | torch.device) -> "Signal":
        """The same signal with its tensors on ``device`` (to train on an accelerator)."""
        move = lambda t: t.to(device)  # noqa: E731
        return Signal(
            move(self.ids), move(self.features), move(self.top_ids), move(self.top_logprobs),
            move(self.starts), move(self.prompt_lens), list(self.domains), list(self.query_ids),
        )

    def select(self, keep: Sequence[int]) -> "Signal":
        """The signal restricted to sequences ``keep`` (in that order)."""
        spans = [torch.arange(int(self.starts[i]), int(self.starts[i + 1])) for i in keep]
        rows = torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)
        lengths = torch.tensor([len(s) for s in spans], dtype=torch.long)
        return Signal(
            self.ids[rows], self.features[rows], self.top_ids[rows], self.top_logprobs[rows],
            torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]), self.prompt_lens[list(keep)],
            [self.domains[i] for i in keep], [self.query_ids[i] for i in keep],
        )

    def by_domain(self, domain: str) -> "Signal":
        return self.select([i for i, d in enumerate(self.domains) if d == domain])

    @staticmethod
    def concat(parts: Sequence["Signal"]) -> "Signal":
        parts = [p for p in parts if len(p)]
        if not parts:
            raise ValueError("nothing to concatenate: every signal is empty")
        starts, total = [torch.zeros(1, dtype=torch.long)], 0
        for part in parts:
            starts.append(part.starts[1:] + total)
            total += part.n_tokens
        return Signal(
            torch.cat([p.ids for p in parts]), torch.cat([p.features for p in parts]),
            torch.cat([p.top_ids for p in parts]), torch.cat([p.top_logprobs for p in parts]),
            torch.cat(starts), torch.cat([p.prompt_lens for p in parts]),
            [d for p in parts for d in p.domains], [q for p in parts for q in p.query_ids],
        )

    def save(self, path: str | os.PathLike[str], metadata: dict | None = None) -> Path:
        """Write atomically (temp file, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            "ids": self.ids, "features": self.features, "top_ids": self.top_ids.to(torch.int32),
            "top_logprobs": self.top_logprobs.to(torch.float16), "starts": self.starts, "prompt_lens": self.prompt_lens,
        }
        meta = {"domains": json.dumps(self.domains), "query_ids": json.dumps(self.query_ids), "info": json.dumps(metadata or {})}
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        os.close(fd)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Signal":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata()
        t = load_file(str(path))
        return cls(
            t["ids"], t["features"], t["top_ids"].long(), t["top_logprobs"].float(), t["starts"], t["prompt_lens"],
            json.loads(meta["domains"]), json.loads(meta["query_ids"]),
        )


def signal_cache_path(target_name: str, queries: Sequence[Query], config: SignalConfig, student_tag: str | None = None) -> Path:
    key = json.dumps([target_name, [q.id for q in queries], asdict(config), student_tag if config.sampling in ("student", "mixed") else None])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir() / "signals" / f"{config.sampling}-{digest}.safetensors"


def build_signal(
    target: PreTrainedModel,
    tokenizer,
    queries: Sequence[Query],
    config: SignalConfig = SignalConfig(),
    student=None,
    cache_as: str | None = None,
    student_tag: str | None = None,
    progress: bool = True,
) -> Signal:
    """Generate (or load from the cache, when ``cache_as`` names the target) the signal for ``queries``.

    ``student``: a :class:`~onlinespec.decoding.feature_head.FeatureHead` (needed by ``student`` and
    ``mixed``); ``student_tag`` identifies its weights in the cache key.
    """
    if config.sampling in ("student", "mixed") and student is None:
        raise ValueError(f"the {config.sampling!r} signal needs a student draft to sample from")
    if not queries:
        raise ValueError("no queries to build a training signal from")
    path = signal_cache_path(cache_as, queries, config, student_tag) if cache_as else None
    if path is not None and path.exists():
        return Signal.load(path)
    generator = torch.Generator().manual_seed(config.seed)
    parts = []
    columns = [TextColumn(f"signal [{config.sampling}]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}")]
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("", total=len(queries), info="")
        made = 0
        for first in range(0, len(queries), config.batch_size):
            batch = list(queries[first: first + config.batch_size])
            parts.append(_generate_batch(target, tokenizer, batch, config, student, generator))
            made += parts[-1].n_tokens
            bar.update(task, advance=len(batch), info=f"{made:,} tokens")
    signal = Signal.concat(parts)
    if path is not None:
        signal.save(path, {"target": cache_as, "config": asdict(config), "student": student_tag})
    return signal


@torch.inference_mode()
def _generate_batch(target, tokenizer, queries: list[Query], config: SignalConfig, student, generator) -> Signal:
    prompts = [encode_prompt(tokenizer, list(q.messages) if q.messages else q.prompt)[-config.max_prompt_tokens:] for q in queries]
    rows, width = len(prompts), max(len(p) for p in prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    decoder, head = target.get_decoder(), target.get_output_embeddings()
    eos = set(eos_token_ids(target, tokenizer))
    cache = DynamicCache(config=target.config)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    hidden = decoder(input_ids=input_ids, attention_mask=mask, position_ids=positions, **cache_arg(decoder, cache)).last_hidden_state
    features = [[hidden[r, width - len(p) + t] for t in range(len(p))] for r, p in enumerate(prompts)]
    tokens = [list(p) for p in prompts]
    generate = config.sampling != "fixed" and config.max_new_tokens > 0
    from_student_row = torch.rand(rows, generator=generator) < config.mix_ratio
    done = [not generate] * rows
    last = hidden[:, -1]
    prev = hidden[:, -2] if width > 1 else hidden[:, -1]  # the feature before the last token (student input)
    for _ in range(config.max_new_tokens if generate else 0):
        logits = head(last).float()
        choice = _choose(logits, config.temperature, generator)
        if config.sampling in ("student", "mixed"):
            student_pick = student.vocab_ids[_choose(student.logits(student.step(prev.float(), torch.tensor([t[-1] for t in tokens]))).float(), config.temperature, generator)]
            use = torch.ones(rows, dtype=torch.bool) if config.sampling == "student" else (
                from_student_row if config.mix_unit == "request" else torch.rand(rows, generator=generator) < config.mix_ratio
            )
            choice = torch.where(use, student_pick, choice)
        for r in range(rows):
            if not done[r]:
                tokens[r].append(int(choice[r]))
                done[r] = int(choice[r]) in eos or len(tokens[r]) - len(prompts[r]) >= config.max_new_tokens
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], -1)
        positions = positions[:, -1:] + 1
        step = decoder(input_ids=choice[:, None], attention_mask=mask, position_ids=positions, **cache_arg(decoder, cache)).last_hidden_state[:, -1]
        for r in range(rows):
            if len(features[r]) < len(tokens[r]):
                features[r].append(step[r])
        prev, last = last, step
        if all(done):
            break
    seq_features = [torch.stack(f) for f in features]
    top_ids, top_logprobs = [], []
    for f in seq_features:
        top = torch.log_softmax(head(f).float(), -1).topk(config.top_k, dim=-1)
        top_ids.append(top.indices)
        top_logprobs.append(top.values)
    lengths = torch.tensor([len(t) for t in tokens])
    return Signal(
        torch.tensor([x for t in tokens for x in t]), torch.cat(seq_features).half(), torch.cat(top_ids), torch.cat(top_logprobs),
        torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]), torch.tensor([len(p) for p in prompts]),
        [q.domain for q in queries], [q.id for q in queries],
    )


def _choose(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator)[:, 0]

