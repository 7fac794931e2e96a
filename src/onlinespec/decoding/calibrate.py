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
from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from onlinespec.decoding.runners.torch_runner import TorchRunner

CONTEXTS = (64, 512)


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


@dataclass
class CostCurve:
    """Seconds of one target forward: ``seconds[(batch, context)][width - 1]``, measured."""

    seconds: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    @classmethod
    def from_widths(cls, costs: list[float], context: int = CONTEXTS[0]) -> "CostCurve":
        """A curve measured for one request at one context length (larger batches: no batching gain assumed)."""
        if not costs:
            raise ValueError("the cost curve needs one cost per block width")
        return cls({(1, context): list(costs)})

    @property
    def batches(self) -> list[int]:
        return sorted({b for b, _ in self.seconds})

    @property
    def max_width(self) -> int:
        return min(len(v) for v in self.seconds.values())

    def cost(self, batch: int, width: int, context: int = CONTEXTS[0]) -> float:
        """Seconds of a forward over ``batch`` rows of ``width`` tokens with ``context`` cached columns."""
        width = max(1, min(width, self.max_width))
        batches = self.batches
        if batch in batches:
            return self._at_batch(batch, width, context)
        if len(batches) == 1 or batch < batches[0]:  # scale from the nearest measured batch
            b = batches[0] if batch < batches[0] else batches[-1]
            return self._at_batch(b, width, context) * batch / b
        i = min(max(bisect_left(batches, batch), 1), len(batches) - 1)
        lo, hi = batches[i - 1], batches[i]
        return _line(batch, lo, self._at_batch(lo, width, context), hi, self._at_batch(hi, width, context))

    def padded(self, batch: int, width: int, context: int = CONTEXTS[0], min_gain: float = 0.05) -> int:
        """The width to run a block of ``width`` at: the cheapest at least as wide, if it saves
        at least ``min_gain`` of the time."""
        if width >= self.max_width:
            return width
        own = self.cost(batch, width, context)
        best = min(range(width, self.max_width + 1), key=lambda w: self.cost(batch, w, context))
        return best if self.cost(batch, best, context) < (1 - min_gain) * own else width

    def padded_cost(self, batch: int, width: int, context: int = CONTEXTS[0]) -> float:
        return self.cost(batch, self.padded(batch, width, context), context)

    def _at_batch(self, batch: int, width: int, context: int) -> float:
        contexts = sorted(c for b, c in self.seconds if b == batch)
        if len(contexts) == 1:
            return self.seconds[(batch, contexts[0])][width - 1]
        i = min(max(bisect_left(contexts, context), 1), len(contexts) - 1)
        lo, hi = contexts[i - 1], contexts[i]
        value = _line(context, lo, self.seconds[(batch, lo)][width - 1], hi, self.seconds[(batch, hi)][width - 1])
        return max(value, 0.5 * self.seconds[(batch, lo)][width - 1])

    def to_dict(self) -> dict:
        return {f"{b}x{c}": v for (b, c), v in sorted(self.seconds.items())}

    def milliseconds(self, digits: int = 2) -> dict:
        """:meth:`to_dict` in milliseconds, rounded: what reports and event logs show."""
        return {key: [round(1000 * t, digits) for t in costs] for key, costs in self.to_dict().items()}

    @classmethod
    def from_dict(cls, saved: dict) -> "CostCurve":
        """The curve :meth:`to_dict` wrote."""
        return cls({tuple(int(x) for x in key.split("x")): [float(t) for t in costs] for key, costs in saved.items()})


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


def _line(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
