"""Deterministic splits: warm-up, online stream and held-out evaluation never overlap.

A query's split is decided by a hash of its id, so a query keeps its split when pools grow or
shrink.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

Q = TypeVar("Q")  # anything with an ``id`` (a :class:`~onlinespec.data.sources.Query`)

SPLITS = ("warmup", "online", "heldout")


def split_of(query_id: str, fractions: Sequence[float] = (0.5, 0.3, 0.2), salt: str = "onlinespec") -> str:
    """The split of a query: warm-up, online stream or held-out evaluation, from a hash of its id."""
    if len(fractions) != len(SPLITS) or abs(sum(fractions) - 1.0) > 1e-9 or min(fractions) < 0:
        raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {tuple(fractions)}")
    u = int.from_bytes(hashlib.sha256(f"{salt}:{query_id}".encode()).digest()[:8], "big") / 2**64
    edge = 0.0
    for name, fraction in zip(SPLITS, fractions):
        edge += fraction
        if u < edge:
            return name
    return SPLITS[-1]


def split(queries: Sequence[Q], name: str, fractions: Sequence[float] = (0.5, 0.3, 0.2)) -> list[Q]:
    """The queries of one split, in their original order."""
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}: use one of {SPLITS}")
    return [q for q in queries if split_of(q.id, fractions) == name]
