"""Prefix caching: the KV cells of finished requests, kept for new requests that begin the same way.

A multi-turn chat sends the whole conversation so far with every turn, and many requests share a
system prompt; vLLM (automatic prefix caching), SGLang (its radix cache) and llama-server (slot
prompt reuse) skip prefilling what an earlier request already computed. Here, on the llama.cpp
backend (``docs/engine.md``, "Prefix caching"):

- a request that ends keeps its sequence's cells as an :class:`Entry` (the tokens they hold, in
  order) instead of clearing them, under its **key**: its tenant and vLLM's ``cache_salt``. A
  lookup sees the entries of its own key only, so no tenant's time to first token ever shows a
  hit on another's cells;
- a new prompt looks up the entry sharing its longest prefix (:meth:`PrefixCache.lookup`); the
  runner copies that entry's cells into the new request's sequence (``llama_memory_seq_cp``) and
  prefills only the rest. At most ``len(prompt) - 1`` tokens are reused: the prompt's last token
  always runs, since its logits choose the first new token;
- entries are bounded by a budget in cells (``--prefix-cache-cells``) and evicted least recently
  used first, and always before a live request would go without a sequence; a purge of the
  request that made an entry (``POST /admin/data/purge``) drops it.

Why one entry per sequence and a scan, not vLLM's hashed blocks: a llama.cpp sequence here has a
stream of its own (``kv_unified`` off, :mod:`onlinespec.decoding.runners.llamacpp`), copied whole
and then cut at any position, so reuse is token-granular as in SGLang's radix tree (hashed
blocks would lose up to a block per hit) and the entries are at most the context's sequences (a
handful): comparing a prompt with each entry of its key is what a radix tree's lookup does with
that few leaves, without a tree to keep consistent under eviction and purge.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Entry", "PrefixCache", "common_prefix"]


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass(eq=False)
class Entry:
    """One finished request's cells: ``tokens`` at positions 0.., in the runner's sequence ``seq``."""

    key: tuple[str, str]  # (tenant, cache_salt): who may hit it
    tokens: np.ndarray
    seq: int
    owner: str | None = None  # the request id that made it (a purge of that id drops it)
    made: float = field(default_factory=time.time)
    used: int = 0  # the LRU clock when it was last made or hit


class PrefixCache:
    """The index of cached entries and their budget; the runner owns the cells (sequences)."""

    def __init__(self, cells: int) -> None:
        if cells < 1:
            raise ValueError(f"the prefix cache needs a budget of at least 1 cell, got {cells}")
        self.budget = cells
        self.entries: list[Entry] = []
        self._clock = itertools.count(1)
        self.evicted_cells = 0  # cells evicted to make room (the budget or a live request), not purged

    @property
    def cells(self) -> int:
        """Cells the entries hold now (at most :attr:`budget`)."""
        return sum(len(e.tokens) for e in self.entries)

    def lookup(self, key: tuple[str, str], prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry of ``key`` sharing the longest prefix with ``prompt``, and how many of its
        tokens to reuse: at most ``len(prompt) - 1`` (the last prompt token must run)."""
        ids = np.asarray(prompt[:-1], dtype=np.int64)
        best, length = None, 0
        for entry in self.entries:
            if entry.key == key:
                n = common_prefix(entry.tokens, ids)
                if n > length:
                    best, length = entry, n
        if best is not None:
            best.used = next(self._clock)
        return best, length

    def add(self, key: tuple[str, str], tokens: list[int], seq: int, owner: str | None) -> list[int]:
        """Keep ``tokens``' cells in ``seq``; return the sequences the runner must clear: entries
        this one covers (a prefix of it), and the least recently used ones past the budget (this
        one too, when it alone is over the budget)."""
        entry = Entry(key, np.asarray(tokens, dtype=np.int64), seq, owner, used=next(self._clock))
        covered = [e for e in self.entries if e.key == key and common_prefix(e.tokens, entry.tokens) == len(e.tokens)]
        self.entries = [e for e in self.entries if e not in covered]
        self.entries.append(entry)
        freed = [e.seq for e in covered]
        while self.cells > self.budget:
            freed.append(self._evict())
        return freed

    def evict(self, keep: Entry | None = None) -> int | None:
        """Evict the least recently used entry other than ``keep`` (a live request needs its
        sequence); its sequence, or None when there is none."""
        if not any(e is not keep for e in self.entries):
            return None
        return self._evict(keep)

    def take(self, entry: Entry) -> int:
        """Remove ``entry`` and hand its sequence over as it is (a request reuses it in place)."""
        self.entries.remove(entry)
        return entry.seq

    def purge(self, owner: str | None = None, before: float | None = None) -> list[int]:
        """Drop the entries made by request ``owner``, or made before ``before`` (a Unix time);
        return their sequences."""
        gone = [e for e in self.entries if (owner is not None and e.owner == owner) or (before is not None and e.made < before)]
        self.entries = [e for e in self.entries if e not in gone]
        return [e.seq for e in gone]

    def clear(self) -> None:
        self.entries = []

    def _evict(self, keep: Entry | None = None) -> int:
        victim = min((e for e in self.entries if e is not keep), key=lambda e: e.used)
        self.entries.remove(victim)
        self.evicted_cells += len(victim.tokens)
        return victim.seq
