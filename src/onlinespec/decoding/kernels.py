"""Small-batch linear kernels: a verification block of 2-16 tokens as ``W @ X^T``.

``nn.Linear`` computes ``X @ W^T``. On the CPUs this project runs on (MKL, fp32), a product with
2-16 rows goes to a GEMM path that packs the weight for every call: the target's 576 x 49,152
output head takes 12-14 ms for 2-5 rows, against 6.7 ms for one row. The same product written
as ``W @ X^T`` runs in 2.7-4.5 ms, and the body's matrices gain 1.3-1.6x. One token alone stays
on the matrix-vector path, except for the large output head, which is faster as two rows.
Whole default target (fp32, 2 threads), ms per forward of 1..6 tokens: stock 39.3 / 65.9 / 84.4
/ 64.2 / 57.8 / 60.7; with these kernels 36.6 / 32.0 / 34.6 / 32.7 / 40.7 / 43.8
(``python bench/kernels_bench.py``).

The choice is measured, never assumed: :func:`use_small_batch_kernels` times the model's forward
per block width with and without the kernels and keeps them only if they are faster in total.
They change the order of floating-point sums, so results differ in the last bits, as they
already do between one-row and many-row products. Apply them to the one target model that the
baseline and the speculative decoder share, so both run the same kernels.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16
LARGE = 4_000_000  # weights with at least this many elements run one row as two (the output head)


def _small_batch_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if rows == 0 or rows > MAX_ROWS or (rows == 1 and self.weight.numel() < LARGE) or x.requires_grad:
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        y = (self.weight @ torch.cat([flat, flat]).T)[:, :1].T
    else:
        y = (self.weight @ flat.T).T
    y = y.reshape(*x.shape[:-1], self.weight.shape[0])
    return y if self.bias is None else y + self.bias


def enable(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(_small_batch_forward, module)


def disable(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear) and "forward" in module.__dict__:
            del module.forward


def enabled(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Linear) and "forward" in m.__dict__ for m in model.modules())


def use_small_batch_kernels(model: nn.Module, max_width: int = 8, reps: int = 5) -> tuple[bool, list[float], list[float]]:
    """Keep the small-batch kernels on ``model`` if they make its forward faster over block widths
    1..max_width in total (``reps`` timed forwards per width). Returns (kept, stock costs, kernel
    costs) in seconds per width."""
    from onlinespec.decoding.calibrate import forward_costs

    if next(model.parameters()).device.type != "cpu" or next(model.parameters()).dtype != torch.float32:
        return False, [], []
    disable(model)
    stock = forward_costs(model, max_width=max_width, reps=reps)
    enable(model)
    fast = forward_costs(model, max_width=max_width, reps=reps)
    keep = sum(fast) < sum(stock) and fast[0] <= stock[0] * 1.02
    if not keep:
        disable(model)
    return keep, stock, fast
