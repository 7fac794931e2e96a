"""What a target forward costs per batch size, block width and context length: the curve that
:mod:`onlinespec.decoding.calibrate` measures and the cost model, adaptive k and the engine read.

A forward over 2 or 3 tokens can cost more than one over 4 on a CPU (BLAS picks its kernel by
the number of rows): :meth:`CostCurve.padded` picks the cheaper width. Attention grows with the
context, so the curve is kept at two context lengths and interpolated between them.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

CONTEXTS = (64, 512)


@dataclass
class CostCurve:
    """Seconds of one target forward: ``seconds[(batch, context)][width - 1]``, measured."""

    seconds: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # read-only once made
    # padded_cost's answers: a step's plan asks it dozens of times (the engine's planning ran 1 ms a
    # step before, 3% of a CPU step); cleared past MEMO entries as the context grows
    _memo: dict[tuple[int, int, int], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    MEMO = 4096

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
        key = (batch, width, context)
        if (known := self._memo.get(key)) is not None:
            return known
        if len(self._memo) >= self.MEMO:
            self._memo.clear()
        self._memo[key] = cost = self.cost(batch, self.padded(batch, width, context), context)
        return cost

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


def _line(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
