"""The small-batch linear kernels, measured: `X @ W^T` (nn.Linear) vs `W @ X^T` per row count on
the default target's matrices, then whole-target forwards of 1..6 tokens with and without them.

    python bench/kernels_bench.py      # about 1 minute on 2 cores; prints markdown tables

The figures in docs/engine.md ("Small-batch linear kernels") come from this script.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from onlinespec.decoding import kernels
from onlinespec.decoding.calibrate import forward_costs
from onlinespec.models import load_model


def per_call_ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def main() -> None:
    target = load_model("default", "float32").model
    layers = {"output head": target.lm_head.weight, "MLP up": target.model.layers[0].mlp.up_proj.weight}
    print("| layer | rows | X @ W^T (ms) | W @ X^T (ms) |\n|---|---|---|---|")
    for name, weight in layers.items():
        for rows in (1, 2, 4, 5):
            x = torch.randn(rows, weight.shape[1])
            stock = per_call_ms(lambda: F.linear(x, weight))
            fast = per_call_ms(lambda: (weight @ x.T).T)
            print(f"| {name} {tuple(weight.shape)} | {rows} | {stock:.3f} | {fast:.3f} |")
    kernels.disable(target)
    stock = forward_costs(target, max_width=6)
    kernels.enable(target)
    fast = forward_costs(target, max_width=6)
    kernels.disable(target)
    print("\n| whole target, ms per forward of | " + " | ".join(str(w) for w in range(1, 7)) + " |")
    print("|---|" + "---|" * 6)
    print("| stock | " + " | ".join(f"{c * 1e3:.1f}" for c in stock) + " |")
    print("| small-batch kernels | " + " | ".join(f"{c * 1e3:.1f}" for c in fast) + " |")


if __name__ == "__main__":
    main()
