"""Measure what a target forward costs per block width, and pad verification blocks accordingly.

On CPUs the BLAS library picks its kernel by the number of rows: on the machines this project
runs on (MKL, AVX-512) a forward over 2 or 3 tokens runs as 2 or 3 matrix-vector products and
costs more than a forward over 4 tokens, which runs as one matrix-matrix product (for the default
target, fp32: 1 token 39 ms, 3 tokens 85 ms, 4 tokens 66 ms). Appending throw-away tokens to a
verification block changes nothing the verification reads (attention is causal; their cache
entries are cut off with the rejected ones) but lets the block run on the faster kernel.

The measured curve is also the verify-cost curve the cost model takes.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache, PreTrainedModel

from onlinespec.decoding.kvcache import truncate_cache


@torch.inference_mode()
def forward_costs(model: PreTrainedModel, max_width: int = 8, context: int = 64, reps: int = 5) -> list[float]:
    """Median seconds of one cached forward over 1..max_width new tokens (logits for all of them)."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(0, vocab, (1, context), generator=generator), cache=cache, logits_to_keep=1)
    costs = []
    for width in range(1, max_width + 1):
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            block = torch.randint(0, vocab, (1, width), generator=generator)
            start = time.perf_counter()
            model(input_ids=block, cache=cache, logits_to_keep=width)
            times.append(time.perf_counter() - start)
            truncate_cache(cache, context)
        costs.append(statistics.median(times[1:]))
    return costs


def padding_plan(costs: list[float], min_gain: float = 0.05) -> dict[int, int]:
    """For each block width, the width to pad it to: the cheapest width at least as large, if it
    saves at least ``min_gain`` of the time. Widths absent from the plan run as they are."""
    plan = {}
    for width in range(1, len(costs) + 1):
        best = min(range(width, len(costs) + 1), key=lambda w: costs[w - 1])
        if costs[best - 1] < (1 - min_gain) * costs[width - 1]:
            plan[width] = best
    return plan
