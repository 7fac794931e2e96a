"""Measure what a target forward costs per batch size, block width and context length.

On CPUs the BLAS library picks its kernel by the number of rows: on the machines this project
runs on (MKL, AVX-512) a forward over 2 or 3 tokens runs as 2 or 3 matrix-vector products and
can cost more than a forward over 4 tokens, which runs as one matrix-matrix product. Appending
throw-away tokens to a verification block changes nothing the verification reads (attention is
causal; their cache columns become holes with the rejected ones) but lets the block run on the
faster kernel: :meth:`CostCurve.padded` picks that width.

The measured curve is the verify cost the cost model and adaptive k take
(:mod:`onlinespec.costmodel`, :mod:`onlinespec.decoding.adaptive`). It is measured over the batch
sizes the engine will run (a step verifies every running request in one forward) and at two
context lengths: attention grows with the context, so a curve measured at 64 tokens under-prices
verification on prompts of several hundred (costs in between are interpolated linearly, beyond
extrapolated from the two).
"""

from __future__ import annotations

import statistics
import time

import torch

from onlinespec.decoding.cost_curve import CONTEXTS, CostCurve
from onlinespec.decoding.runners.torch_runner import TorchRunner


@torch.inference_mode()
def forward_costs(target, max_width: int = 8, context: int = 64, reps: int = 5, batch: int = 1) -> list[float]:
    """Median seconds of one verify forward of ``target`` (a runner, :mod:`onlinespec.decoding.runners`,
    or a Hugging Face model), as the engine runs it, over ``batch`` rows of 1..max_width new tokens
    after ``context`` tokens."""
    runner = as_runner(target)
    vocab = runner.vocab_size
    generator = torch.Generator().manual_seed(0)
    rows = [object() for _ in range(batch)]
    for row in rows:
        runner.forward_alone(row, torch.randint(0, vocab, (context,), generator=generator).tolist(), 1)
        runner.join(row, context)
    for _ in range(2):  # warm-up: a backend's first forwards at a new shape build and allocate their graphs
        runner.forward(torch.randint(0, vocab, (batch, max_width), generator=generator).tolist())
        runner.rewind()
    costs = []
    for width in range(1, max_width + 1):
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            blocks = torch.randint(0, vocab, (batch, width), generator=generator).tolist()
            start = time.perf_counter()
            runner.forward(blocks)
            times.append(time.perf_counter() - start)
            runner.rewind()
        costs.append(statistics.median(times[1:]))
    runner.release(rows)
    return costs


def measure_cost_curve(
    target,
    max_width: int = 8,
    batches: tuple[int, ...] = (1,),
    contexts: tuple[int, ...] = CONTEXTS,
    reps: int = 3,
) -> CostCurve:
    """Time the target's forward over every (batch, context) pair and block widths 1..max_width.
    ``target``: a runner (:mod:`onlinespec.decoding.runners`, left empty), or a Hugging Face
    model (timed on a :class:`~onlinespec.decoding.runners.torch_runner.TorchRunner`)."""
    runner = as_runner(target)
    seconds = {}
    for batch in sorted(set(batches)):
        for context in contexts:
            seconds[(batch, context)] = forward_costs(runner, max_width, context, reps, batch)
    runner.reset()
    return CostCurve(seconds)


def as_runner(target):
    """``target`` as a runner: a Hugging Face model gets a :class:`TorchRunner` (no padding)."""
    return TorchRunner(target, pad=False) if isinstance(target, torch.nn.Module) else target


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes to measure for an engine that runs up to ``max_batch`` requests: powers of two and the maximum."""
    sizes = {1, max_batch}
    size = 2
    while size < max_batch:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


