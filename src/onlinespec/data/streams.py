"""Deterministic splits and query streams (arXiv 2310.07177, section 5: online, shifts, mixes).

Splits are decided by a hash of each query's id, so a query keeps its split when pools grow or
shrink, and the warm-up, online and held-out splits never overlap.

Streams:
- :func:`abrupt_shifts`: domain A for ``every`` records, then B, then C ... (Figure 4);
- :func:`gradual_mix`: the share of the next domain rises linearly across each transition;
- :func:`random_mix`: domains drawn independently with given weights;
- :func:`segments`: domains in a given order, a domain may come back (code -> maths -> chat -> code).
A single-domain stream is ``abrupt_shifts({d: pool}, every=n)``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence

from onlinespec.data.sources import Query

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


def split(queries: Sequence[Query], name: str, fractions: Sequence[float] = (0.5, 0.3, 0.2)) -> list[Query]:
    """The queries of one split, in their original order."""
    if name not in SPLITS:
        raise ValueError(f"unknown split {name!r}: use one of {SPLITS}")
    return [q for q in queries if split_of(q.id, fractions) == name]


def abrupt_shifts(pools: Mapping[str, Sequence[Query]], every: int | Mapping[str, int], seed: int = 0) -> list[Query]:
    """``every`` queries of each domain in turn (or ``every[domain]``), in the mapping's order
    (each pool shuffled)."""
    rng = random.Random(seed)
    stream: list[Query] = []
    for domain, pool in pools.items():
        stream += _draw(pool, every if isinstance(every, int) else every[domain], rng, domain)
    return stream


def segments(pools: Mapping[str, Sequence[Query]], order: Sequence[tuple[str, int]], seed: int = 0) -> list[Query]:
    """``n`` queries of each ``(domain, n)`` of ``order`` in turn; a domain that comes back
    continues its shuffled pool (no query is served twice)."""
    rng = random.Random(seed)
    needed: dict[str, int] = {}
    for domain, n in order:
        needed[domain] = needed.get(domain, 0) + n
    shuffled = {d: _draw(pools[d], n, rng, d) for d, n in needed.items()}
    cursor = dict.fromkeys(needed, 0)
    return [_next(shuffled, cursor, domain) for domain, n in order for _ in range(n)]


def gradual_mix(pools: Mapping[str, Sequence[Query]], every: int, seed: int = 0) -> list[Query]:
    """Like :func:`abrupt_shifts`, but within each block the next domain's share rises from 0 to 1."""
    rng = random.Random(seed)
    domains = list(pools)
    shuffled = {d: _draw(pools[d], len(pools[d]), rng, d) for d in domains}
    cursor = dict.fromkeys(domains, 0)
    stream: list[Query] = []
    for i, domain in enumerate(domains):
        following = domains[i + 1] if i + 1 < len(domains) else None
        for j in range(every):
            pick = following if following and rng.random() < j / every else domain
            stream.append(_next(shuffled, cursor, pick))
    return stream


def random_mix(pools: Mapping[str, Sequence[Query]], n: int, weights: Mapping[str, float] | None = None, seed: int = 0) -> list[Query]:
    """``n`` queries, each from a domain drawn independently (by ``weights``, default uniform)."""
    rng = random.Random(seed)
    domains = list(pools)
    shuffled = {d: _draw(pools[d], len(pools[d]), rng, d) for d in domains}
    cursor = dict.fromkeys(domains, 0)
    chosen = rng.choices(domains, weights=[(weights or {}).get(d, 1.0) for d in domains], k=n)
    return [_next(shuffled, cursor, d) for d in chosen]


def _draw(pool: Sequence[Query], n: int, rng: random.Random, domain: str) -> list[Query]:
    if n > len(pool):
        raise ValueError(f"the {domain!r} pool has {len(pool)} queries; the stream needs {n}")
    return rng.sample(list(pool), n)


def _next(shuffled: dict[str, list[Query]], cursor: dict[str, int], domain: str) -> Query:
    if cursor[domain] >= len(shuffled[domain]):
        raise ValueError(f"the {domain!r} pool ran out after {cursor[domain]} queries; use a larger pool or a shorter stream")
    cursor[domain] += 1
    return shuffled[domain][cursor[domain] - 1]
