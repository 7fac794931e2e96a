"""Sampling parameters and the logits -> probabilities warp shared by target and draft.

Names follow Hugging Face ``generate`` (``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``,
``stop_strings``) and vLLM's ``SamplingParams`` for the rest. ``temperature == 0`` means greedy
decoding; as in vLLM, a temperature below ``GREEDY_BELOW`` (1e-5) is greedy too (dividing logits
by it would overflow float32 to inf, and the distribution it asks for is the argmax's up to ties).
NaN and infinite values are refused.

The target's distribution for a request is, in vLLM's order: its logits, then the processors that
read the request's history (``logit_bias``, ``min_tokens``, the penalties:
:func:`onlinespec.decoding.processors.apply_processors`), then :func:`logits_to_probs`
(temperature, ``min_p``, top-k, top-p). Greedy decoding takes the argmax after the processors.
Speculative decoding verifies against exactly this distribution, so its output follows the
processed target's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # the most alternatives a request may ask for at each position (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int | None = 128  # None: all the context leaves (SpeculativeEngine.budget resolves it per prompt)
    temperature: float = 0.0  # the library's default, greedy; the HTTP server always passes OpenAI's (serve.protocol.DEFAULT_TEMPERATURE)
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # per-request generator seed (sampling only)
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability (after temperature)
    repetition_penalty: float = 1.0  # > 1: tokens of the prompt or the output are less likely (logit / p if > 0, else x p)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits
    stop_token_ids: tuple[int, ...] = ()  # these tokens end the request (kept in its token ids, as EOS is)
    min_tokens: int = 0  # no EOS nor stop token (nor stop string) before this many new tokens
    logprobs: int | None = None  # None: none; n: each new token's log probability and the n most likely at its place
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    constraint: object | None = None  # a decoding.grammar.Constraint the output must match (structured output)

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
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
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in dict(self.logit_bias).items()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._check_processors()

    def _check_processors(self) -> None:
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise ValueError("logit_bias: token ids must be >= 0 and biases in [-100, 100]")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        if self.min_tokens < 0 or (self.max_new_tokens is not None and self.min_tokens > self.max_new_tokens):
            raise ValueError(f"min_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processed(self) -> bool:
        """Whether a processor that reads the history changes the target's logits (the fast path skips them)."""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0
                    or self.presence_penalty or self.frequency_penalty)

    @property
    def reproducible(self) -> bool:
        """Seeded sampling: the request's text must depend on its seed alone (so it drafts and
        verifies the same whatever else is batched, and drafts from its own text only)."""
        return not self.greedy and self.seed is not None


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., V]`` into the sampling distribution: temperature, then min-p, then top-k,
    then top-p (vLLM's order).

    This is the distribution the target samples from when decoding alone; speculative decoding
    must reproduce exactly this distribution, so both paths call this one function.
    """
    logits = logits.float() / params.temperature
    if params.min_p > 0:  # relative to the most likely token: log p(x) < log min_p + max log p
        logprobs = logits.log_softmax(-1)
        logits = logits.masked_fill(logprobs < logprobs.max(-1, keepdim=True).values + math.log(params.min_p), float("-inf"))
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
    """Draw one token id from a 1-D distribution (not necessarily normalised): the first token
    whose cumulative probability passes one uniform draw (in float64). A token of probability 0
    is never drawn. Every sampled token of the engine, the drafts and the verifier comes from here.

    ``torch.multinomial`` draws one exponential variate per vocabulary entry on a CPU: 1.8 ms over
    a 49k vocabulary on this project's test machine, against 0.1 ms for this, about a tenth of a
    135M target's step saved for each token a sampled request drafts or verifies.
    """
    cdf = probs.double().cumsum(-1)
    u = torch.rand(1, dtype=torch.float64, device=cdf.device, generator=generator) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))
    if index >= len(cdf):  # u rounded up to the total (about 2^-53 of draws): the last token drawable
        index = int(torch.nonzero(probs > 0)[-1])
    return index
