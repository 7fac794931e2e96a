"""Query streams (arXiv 2310.07177, section 5: online, shifts, mixes); the splits they draw from
are :mod:`onlinespec.data.splits`.

Streams:
- :func:`abrupt_shifts`: domain A for ``every`` records, then B, then C ... (Figure 4);
- :func:`gradual_mix`: the share of the next domain rises linearly across each transition;
- :func:`random_mix`: domains drawn independently with given weights;
- :func:`segments`: domains in a given order, a domain may come back (code -> maths -> chat -> code).
A single-domain stream is ``abrupt_shifts({d: pool}, every=n)``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from onlinespec.data.sources import Query


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
