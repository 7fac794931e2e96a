"""The paper's cost model of speculative decoding (arXiv 2310.07177, background), and its inverse.

Symbols, as in the paper:
- ``alpha``: probability that the target accepts a proposal (i.i.d. approximation);
- ``k``: proposals per round;
- ``c``: time of one draft step / time of one target step;
- ``verify_cost``: time of the target's verification pass over ``k + 1`` tokens / one target
  step. The paper takes it as 1 (decoding is memory-bound); on a CPU it grows with ``k``, so
  every function takes it, measured, when known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

VerifyCost = float | Callable[[int], float]  # a constant, or a function of k


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E = (1 - alpha^(k+1)) / (1 - alpha): tokens a round emits (accepted + the target's one)."""
    _check_alpha(alpha)
    if alpha == 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(alpha: float, k: int, c: float, verify_cost: VerifyCost = 1.0) -> float:
    """Expected speedup over target-alone decoding: E / (c k + verify_cost)."""
    v = verify_cost(k) if callable(verify_cost) else verify_cost
    return expected_tokens_per_round(alpha, k) / (c * k + v)


def best_k(alpha: float, c: float, k_max: int = 16, verify_cost: VerifyCost = 1.0) -> int:
    """The k in 1..k_max with the highest expected speedup."""
    return max(range(1, k_max + 1), key=lambda k: speedup(alpha, k, c, verify_cost))


def osd_gain(alpha_before: float, alpha_after: float, k: int) -> float:
    """Speedup of online over static speculative decoding when alpha rises (fixed k and c)."""
    return expected_tokens_per_round(alpha_after, k) / expected_tokens_per_round(alpha_before, k)


def alpha_from_tokens_per_round(tokens_per_round: float, k: int) -> float:
    """Invert E(alpha, k) by bisection: the alpha that explains a measured tokens-per-round."""
    if not 1.0 <= tokens_per_round <= k + 1:
        raise ValueError(f"tokens per round must lie in [1, k + 1] = [1, {k + 1}], got {tokens_per_round}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_round(mid, k) < tokens_per_round else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class CostEstimate:
    """alpha, c and the verify cost measured from real runs, and what the model predicts from them."""

    alpha: float
    k: int
    c: float
    verify_cost: float

    @property
    def predicted_speedup(self) -> float:
        return speedup(self.alpha, self.k, self.c, self.verify_cost)

    @property
    def paper_predicted_speedup(self) -> float:
        """The paper's formula as printed (verification as cheap as one step)."""
        return speedup(self.alpha, self.k, self.c, 1.0)


def estimate(
    accepted: int,
    rejected: int,
    k: int,
    draft_seconds_per_step: float,
    target_seconds_per_step: float,
    verify_seconds_per_round: float,
) -> CostEstimate:
    """alpha = accepted / (accepted + rejected): the share of target-judged proposals accepted,
    the maximum-likelihood alpha under the i.i.d. model; c and the verify cost from timings."""
    judged = accepted + rejected
    if judged == 0 or target_seconds_per_step <= 0:
        raise ValueError("need at least one judged proposal and a positive target step time")
    return CostEstimate(
        alpha=accepted / judged,
        k=k,
        c=draft_seconds_per_step / target_seconds_per_step,
        verify_cost=verify_seconds_per_round / target_seconds_per_step,
    )


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
