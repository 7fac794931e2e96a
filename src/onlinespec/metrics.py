"""Measurement helpers shared by reports, benchmarks and the server's per-request figures."""

from __future__ import annotations

import random
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def speculative_decoding(stats) -> dict:
    """One request's speculation figures, named as vLLM's spec-decode metrics name them.

    A draft is one round that sent proposals; ``mean_acceptance_length`` counts the target's own
    token too (1 + accepted per draft, vLLM's definition); ``draft_acceptance_rate`` is accepted
    over drafted tokens, while ``alpha`` is the paper's (arXiv 2310.07177, section 3): accepted
    over the proposals the target judged (those after a round's first rejection never are).
    ``acceptance_histogram[n]``: drafts that kept n proposals. ``stats``: a
    :class:`~onlinespec.decoding.request.RequestStats`.
    """
    drafts = sum(stats.accepted_histogram)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": stats.proposed,
        "num_accepted_tokens": stats.accepted,
        "num_judged_tokens": stats.accepted + stats.rejected,
        "num_accepted_tokens_per_pos": list(stats.step_accepted),
        "acceptance_histogram": list(stats.accepted_histogram),
        "mean_acceptance_length": 1 + stats.accepted / drafts if drafts else 1.0,
        "draft_acceptance_rate": stats.accepted / stats.proposed if stats.proposed else 0.0,
        "alpha": stats.acceptance_rate,
        "tokens_per_target_forward": stats.mean_accepted_length,
        "by_drafter": {name: {"draft_tokens": sent, "accepted_tokens": kept} for name, (sent, kept) in stats.by_drafter.items()},
    }


def moving_average(values: Sequence[float], window: int = 50) -> list[float]:
    """Per position, the mean of the last ``window`` values (as the paper plots alpha)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def median_ratio(pairs: Sequence[tuple[float, float]]) -> float:
    """The median of a / b over ``(a, b)`` pairs with b > 0 (a per-request speed-up)."""
    ratios = sorted(a / b for a, b in pairs if b)
    if not ratios:
        return 0.0
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def bootstrap_ratio(samples: Sequence[tuple[float, float, float, float]], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% interval of the pooled rate ratio (sum tokens_a / sum seconds_a) / (sum tokens_b /
    sum seconds_b) over ``(tokens_a, seconds_a, tokens_b, seconds_b)`` samples (one per request,
    paired: a request keeps both its measurements), resampled with replacement, fixed seed."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        pick = [samples[rng.randrange(len(samples))] for _ in samples]
        sums = [sum(s[j] for s in pick) for j in range(4)]
        ratios.append((sums[0] / sums[1]) / (sums[2] / sums[3]) if sums[1] and sums[2] and sums[3] else 0.0)
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]
