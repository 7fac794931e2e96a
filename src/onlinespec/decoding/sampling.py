"""Sampling parameters and the logits -> probabilities warp shared by target and draft.

Names follow Hugging Face ``generate`` (``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``,
``stop_strings``). ``temperature == 0`` means greedy decoding; as in vLLM, a temperature below
``GREEDY_BELOW`` (1e-5) is greedy too (dividing logits by it would overflow float32 to inf, and
the distribution it asks for is the argmax's up to ties). NaN and infinite values are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import torch

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # per-request generator seed (sampling only)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        stops = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
        object.__setattr__(self, "stop_strings", stops)  # a tuple, so the params stay hashable
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def reproducible(self) -> bool:
        """Seeded sampling: the request's text must depend on its seed alone (so it drafts and
        verifies the same whatever else is batched, and drafts from its own text only)."""
        return not self.greedy and self.seed is not None


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., V]`` into the sampling distribution: temperature, then top-k, then top-p.

    This is the distribution the target samples from when decoding alone; speculative decoding
    must reproduce exactly this distribution, so both paths call this one function.
    """
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
