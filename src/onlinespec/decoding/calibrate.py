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


def forward_costs(target, max_width: int = 8, context: int = 64, reps: int = 5, batch: int = 1) -> list[float]:
    """Median seconds of one verify forward of ``target`` (a runner, :mod:`onlinespec.decoding.runners`,
    or a Hugging Face model), as the engine runs it, over ``batch`` rows of 1..max_width new tokens
    after ``context`` tokens."""
    return _costs_by_batch(as_runner(target), max_width, context, reps, (batch,))[batch]


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
    for context in contexts:
        for batch, costs in _costs_by_batch(runner, max_width, context, reps, tuple(sorted(set(batches)))).items():
            seconds[(batch, context)] = costs
    runner.reset()
    return CostCurve(seconds)


@torch.inference_mode()
def _costs_by_batch(runner, max_width: int, context: int, reps: int, batches: tuple[int, ...]) -> dict[int, list[float]]:
    """Per batch size (ascending), the median seconds of a verify forward over that many rows of
    1..max_width new tokens after ``context`` tokens. One row prefills the context; the others
    copy its cells (``runner.fork``, where the runner can: each row still holds cells of its own,
    so attention reads as much as over distinct prompts), and the batch grows by joining more of
    them: a context is prefilled once for the whole curve, not once per row of every batch size
    (at 512 tokens, 7 s a row for the 135M default on one core of a slow 2-core CPU)."""
    vocab = runner.vocab_size
    generator = torch.Generator().manual_seed(0)
    rows = [object() for _ in range(max(batches))]
    runner.forward_alone(rows[0], torch.randint(0, vocab, (context,), generator=generator).tolist(), 1)
    for row in rows[1:]:
        if not runner.fork(rows[0], row, context):  # a runner that cannot copy cells: the row prefills its own
            runner.forward_alone(row, torch.randint(0, vocab, (context,), generator=generator).tolist(), 1)
    costs, joined = {}, 0
    for batch in batches:
        for row in rows[joined:batch]:
            runner.join(row, context)
        joined = batch
        for _ in range(2):  # warm-up: a backend's first forwards at a new shape build and allocate their graphs
            runner.forward(torch.randint(0, vocab, (batch, max_width), generator=generator).tolist())
            runner.rewind()
        costs[batch] = []
        for width in range(1, max_width + 1):
            times = []
            for _ in range(reps + 1):  # the first is a warm-up
                blocks = torch.randint(0, vocab, (batch, width), generator=generator).tolist()
                start = time.perf_counter()
                runner.forward(blocks)
                times.append(time.perf_counter() - start)
                runner.rewind()
            costs[batch].append(statistics.median(times[1:]))
    runner.release(rows)
    return costs


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


