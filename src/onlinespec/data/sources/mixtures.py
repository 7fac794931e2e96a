"""The named sources, and the pools and mixtures of queries drawn from them by domain."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from onlinespec.data.sources.chat import load_chitchat, load_sharegpt
from onlinespec.data.sources.gsm import load_gsm_symbolic
from onlinespec.data.sources.humaneval import load_humaneval
from onlinespec.data.sources.query import Query
from onlinespec.data.sources.stdlib import load_stdlib_code

DOMAINS: tuple[str, ...] = ("chat", "code", "math")
"""The English domains that :func:`packaged_prompts` can draw from."""


@dataclass(frozen=True)
class Source:
    """A named query source: a no-argument loader and a one-line description."""

    loader: Callable[[], list[Query]]
    description: str


SOURCES: dict[str, Source] = {
    "humaneval": Source(load_humaneval, "HumanEval: 164 Python function completions (code)"),
    "sharegpt": Source(
        load_sharegpt, "ShareGPT: opening turns of real ChatGPT sessions (chat + code)"
    ),
    "chitchat": Source(load_chitchat, "Chit Chat Challenge: human chat openers (chat)"),
    "gsm_symbolic": Source(
        load_gsm_symbolic, "GSM-Symbolic: 100 grade-school maths questions, English (math)"
    ),
}
"""Source name -> loader and description, e.g. for a CLI ``sources`` listing."""


def english_pools(domains: Sequence[str]) -> dict[str, list[Query]]:
    """Every English query of each domain: chat = ShareGPT chat + chitchat, code = HumanEval +
    ShareGPT code, math = GSM-Symbolic English (only 100 problems)."""
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        raise ValueError(f"unknown domain(s) {unknown}: use names from {DOMAINS}")
    sharegpt = load_sharegpt() if {"chat", "code"} & set(domains) else []
    builders: dict[str, Callable[[], list[Query]]] = {
        "chat": lambda: [q for q in sharegpt if q.domain == "chat"] + load_chitchat(),
        "code": lambda: load_humaneval() + [q for q in sharegpt if q.domain == "code"],
        "math": lambda: load_gsm_symbolic("eng"),
    }
    return {d: builders[d]() for d in domains}


MATH_ML_LANGUAGES: tuple[str, ...] = (
    "eng", "eng_metric", "deu", "fra", "spa", "ita", "por", "nld", "cat", "ron", "dan", "swe", "nob", "afr", "ind", "zlm",
    "pol", "ces", "slk", "slv", "hrv", "bos", "tgl",
)
"""The GSM-Symbolic languages of the ``math_ml`` domain: 23 in Latin script, English included."""

STREAM_DOMAINS: tuple[str, ...] = (*DOMAINS, "math_ml", "stdlib")
"""Domains a query stream can draw from: the English ones, ``math_ml`` (maths in 23 languages) and
``stdlib`` (functions of this machine's Python standard library to complete; see
:func:`load_stdlib_code`). The packaged draft saw neither ``math_ml`` nor ``stdlib``."""


def stream_pools(domains: Sequence[str]) -> dict[str, list[Query]]:
    """Every query of each domain, as :func:`english_pools`, plus ``math_ml``: the GSM-Symbolic
    problems in :data:`MATH_ML_LANGUAGES`, each relabelled with domain ``math_ml``."""
    unknown = [d for d in domains if d not in STREAM_DOMAINS]
    if unknown:
        raise ValueError(f"unknown domain(s) {unknown}: use names from {STREAM_DOMAINS}")
    pools = english_pools([d for d in domains if d in DOMAINS])
    if "stdlib" in domains:
        pools["stdlib"] = load_stdlib_code()
    if "math_ml" in domains:
        pools["math_ml"] = [
            dataclasses.replace(q, domain="math_ml") for lang in MATH_ML_LANGUAGES for q in load_gsm_symbolic(lang)
        ]
    return {d: pools[d] for d in domains}


def _round_robin(groups: Iterable[list[Query]]) -> list[Query]:
    return [q for row in itertools.zip_longest(*groups) for q in row if q is not None]


def packaged_prompts(n: int, domains: Sequence[str] = DOMAINS, seed: int = 0, split: str | None = None) -> list[Query]:
    """``n`` English queries spread evenly over ``domains``, interleaved round-robin.

    ``split``: draw only from that split (``warmup``, ``online`` or ``heldout``; see
    :func:`onlinespec.data.splits.split_of`); evaluate a warmed draft on ``heldout``.

    Pools: chat = ShareGPT chat + chitchat; code = HumanEval + ShareGPT code; math =
    GSM-Symbolic English. Each pool is shuffled with ``random.Random(f"{seed}:{domain}")``
    (so a domain's sample does not depend on the other domains) and its first items taken;
    the first ``n % len(domains)`` domains get one extra query.
    """
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown or not domains or len(set(domains)) != len(domains):
        raise ValueError(f"domains must be distinct names from {DOMAINS}, got {tuple(domains)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pools = english_pools(domains)
    picked: list[list[Query]] = []
    for i, domain in enumerate(domains):
        want = n // len(domains) + (i < n % len(domains))
        pool = pools[domain]
        if split is not None:
            from onlinespec.data.splits import split as split_queries

            pool = split_queries(pool, split)
        if want > len(pool):
            where = f" in the {split!r} split" if split else ""
            raise ValueError(f"asked for {want} {domain!r} queries but only {len(pool)} exist{where}")
        random.Random(f"{seed}:{domain}").shuffle(pool)
        picked.append(pool[:want])
    return _round_robin(picked)
