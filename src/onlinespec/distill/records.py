"""The training signal a distillation step reads: shared by the online recorder (which makes
records from verification traces, :mod:`onlinespec.online.recorder`), the replay buffer and the
trainers, so it lives below all of them."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

import torch


@dataclass
class DistillRecord:
    """One request's training signal: its tokens and the target's top-K at chosen positions."""

    token_ids: list[int]  # prompt + generated output
    positions: list[int]  # t: learn p(token_ids[t] | token_ids[:t]) from the draft's logits at t - 1
    top_ids: torch.Tensor  # [len(positions), K] int64: the target's top-K token ids at t
    top_logprobs: torch.Tensor  # [len(positions), K] float32: their log-probabilities (temperature 1)
    prompt_len: int
    domain: str = "default"
    request_id: str = ""
    # feature heads only: [len(positions), H] float16, the target's post-norm state at t - 1
    features: torch.Tensor | None = None
    rejected: list[bool] | None = None  # per position: the row of a round's first rejection
    created_at: float = field(default_factory=time.time)  # when it was recorded: retention reads it

    def __len__(self) -> int:
        return len(self.positions)

    def digest(self) -> str:
        """What this record holds, as a short hash (its request id, tokens, positions and domain):
        a record stored twice (a replica's retry) is known by its content, never by a client's
        header alone (two requests sent with one ``X-Request-Id`` are two records)."""
        body = json.dumps([self.request_id, self.token_ids, self.positions, self.domain, self.prompt_len])
        return hashlib.sha256(body.encode()).hexdigest()[:20]
