"""One memory budget for everything a serving process learns and keeps (docs/reliability.md,
"Memory budget"): the replay buffers (:mod:`onlinespec.online.buffer`), the suffix indexes
(:mod:`onlinespec.decoding.proposers.suffix`) and the drafts in memory.

Each holder registers with the process's :class:`MemoryBudget` and says, when asked, how many
bytes it holds (measured, not guessed: ``element_size * numel`` of its tensors, ``nbytes`` of its
arrays, ``sys.getsizeof`` of its Python objects) and how to give some back. A holder that grew
calls :meth:`MemoryBudget.check`, which enforces the policy:

1. the suffix indexes together stay under ``suffix_share`` of the budget: past it, the largest
   index drops its least-recently-used tenant's documents (oldest first) until the indexes use at
   most 90% of their share (the slack spares a rebuild per request);
2. everything together stays under the budget: past it, the largest replay buffer drops its
   oldest records (from disk too, as its own bounds do) until the total is back under; then, if
   buffers cannot give enough, the largest suffix index sheds as above.

Drafts are counted, not evicted here: how many are in memory is content routing's bound
(``--max-drafts``). So are the prefix cache's KV cells (:class:`PrefixCacheMemory`): their bound
is ``--prefix-cache-cells``, and its own LRU evicts them. Every eviction is an event (``memory_evicted``: the holder's kind and name,
what it dropped, the bytes before and after) and counts in :attr:`MemoryBudget.evictions`, by
kind; ``/metrics`` shows the budget, the bytes used by kind and the evictions
(:mod:`onlinespec.serve.metrics`).

The process has one budget (:func:`budget`); the server sets its limit (``--memory-budget``,
:func:`configure`). Tests give a holder a budget of its own.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("onlinespec.memory")

KINDS = ("replay_buffer", "suffix_index", "draft", "prefix_cache")  # the only labels /metrics ever shows
SUFFIX_SHARE = 0.25  # of the budget, the most the suffix indexes may use together
SLACK = 0.9  # a suffix index sheds down to this fraction of its allowance (a rebuild per shed)
_UNITS = {"": 2**20, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def physical_memory() -> int:
    """The machine's RAM in bytes (0 if the system will not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def default_limit() -> int:
    """A quarter of the machine's RAM, at least 1 GiB and at most 8 GiB: the target model, its KV
    cache and the Python process itself live outside the budget and need the rest; 8 GiB holds
    eight drafts' full replay buffers (512 MiB each) and their suffix indexes with room to spare.
    The floor: the default draft alone counts 300-450 MB (its model, and after an update the
    candidate and Adam's state), and drafts are never evicted, so a smaller budget leaves the
    buffers and indexes nothing (measured: bench/soak_memory.py at 256 MiB emptied them)."""
    ram = physical_memory() or 4 * 2**30
    return int(min(max(ram // 4, 2**30), 8 * 2**30))


def parse_size(text: str | int) -> int:
    """Bytes from ``"512MiB"``, ``"2GiB"``, ``"1.5G"``, ``"300MB"``; a bare number is MiB."""
    if isinstance(text, int):
        return text
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = found.group(2).lower() if found else None
    if not found or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r}; write it as 512MiB, 2GiB or 1.5G (a bare number is MiB)")
    size = int(float(found.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"a memory budget must be positive, got {text!r}")
    return size


def object_bytes(value) -> int:
    """The bytes ``value`` holds: a tensor's ``element_size() * numel()``, an array's ``nbytes``,
    a list's ``sys.getsizeof`` plus its int objects that are not CPython's shared small ints
    (-5..256), None 0."""
    if value is None:
        return 0
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size() * value.numel())
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if isinstance(value, (list, tuple)):
        return sys.getsizeof(value) + sum(sys.getsizeof(v) for v in value if type(v) is int and not -5 <= v <= 256)
    return sys.getsizeof(value)


class Holder(Protocol):
    memory_kind: str  # one of KINDS
    memory_name: str  # for events: the draft or folder it belongs to

    def memory_bytes(self) -> int: ...

    def shed(self, nbytes: int) -> dict | None:
        """Give back at least ``nbytes`` if it can, by its own policy; what it dropped (for the
        event: counts, and ``items``, how many records or documents), or None if nothing."""


class MemoryBudget:
    """The bytes the registered holders may use together. Every method may be called from any
    thread; a holder calls :meth:`check` without holding its own lock (check takes holders' locks)."""

    def __init__(self, limit: int, suffix_share: float = SUFFIX_SHARE, on_event: Callable[[dict], None] | None = None) -> None:
        if limit < 1 or not 0 < suffix_share <= 1:
            raise ValueError(f"a budget needs a positive limit and a share in (0, 1], got {limit} and {suffix_share}")
        self.limit, self.suffix_share, self.on_event = int(limit), suffix_share, on_event
        self.evictions = dict.fromkeys(KINDS, 0)  # records or documents dropped, by the holder's kind
        self.evicted_bytes = dict.fromkeys(KINDS, 0)
        self.over = 0  # checks that found the budget exceeded with nothing left to evict
        self._holders: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.RLock()

    def register(self, holder: Holder) -> None:
        if holder.memory_kind not in KINDS:
            raise ValueError(f"unknown memory holder kind {holder.memory_kind!r}: use one of {KINDS}")
        self._holders.add(holder)

    def unregister(self, holder: Holder) -> None:
        self._holders.discard(holder)

    def holders(self, kind: str | None = None) -> list[Holder]:
        return [h for h in list(self._holders) if kind is None or h.memory_kind == kind]

    def used(self) -> dict[str, int]:
        """Bytes held now, by kind."""
        used = dict.fromkeys(KINDS, 0)
        for holder in self.holders():
            used[holder.memory_kind] += holder.memory_bytes()
        return used

    def total(self) -> int:
        return sum(self.used().values())

    def check(self) -> None:
        """Enforce the policy (module docstring): suffix indexes under their share, everything
        under the limit, evicting and reporting what went."""
        with self._lock:
            share = int(self.limit * self.suffix_share)
            self._shed_until("suffix_index", share, int(share * SLACK))
            if self.total() <= self.limit:
                return
            for kind in ("replay_buffer", "suffix_index"):
                if self._shed_until(kind, None, None) and self.total() <= self.limit:
                    return
            self.over += 1
            if self.over == 1 or self.over % 1000 == 0:
                self._emit({"event": "memory_over_budget", "budget": self.limit, "used": self.used(),
                            "note": "nothing left to evict (drafts are bounded by --max-drafts)"})

    def _shed_until(self, kind: str, allowance: int | None, target: int | None) -> bool:
        """While ``kind``'s holders use more than ``allowance`` (None: while the total is over the
        limit), the largest sheds down towards ``target``; True if any shed."""
        shed_any = False
        while True:
            holders = self.holders(kind)
            sizes = {id(h): h.memory_bytes() for h in holders}
            held = sum(sizes.values())
            excess = held - allowance if allowance is not None else self.total() - self.limit
            if excess <= 0 or not holders:
                return shed_any
            largest = max(holders, key=lambda h: sizes[id(h)])
            need = held - target if target is not None else excess
            before = sizes[id(largest)]
            dropped = largest.shed(need)
            if not dropped:
                return shed_any
            after = largest.memory_bytes()
            shed_any = True
            self.evictions[kind] += int(dropped.get("items", 0))
            self.evicted_bytes[kind] += max(0, before - after)
            self._emit({"event": "memory_evicted", "kind": kind, "holder": largest.memory_name, **dropped,
                        "bytes_before": before, "bytes_after": after, "budget": self.limit})

    def _emit(self, event: dict) -> None:
        log.info("memory budget: %s", event)
        if self.on_event is not None:
            try:
                self.on_event({**event, "time": time.time()})
            except Exception:  # an event log that fails never stops an eviction
                log.exception("the memory budget's event could not be written")


class OwnBytes(int):
    """A size its holder measured once itself, counted as it is by :func:`tensors_bytes`: an int8
    serving copy's packed matrices, which are no parameters and which torch unpacks (a copy) to
    show (:func:`onlinespec.decoding.feature_head.served_copy`)."""


def tensors_bytes(objects) -> int:
    """Bytes of the distinct tensors in ``objects``: torch modules (parameters and buffers),
    tensors, and dicts or lists of them (an optimizer's state), each storage counted once; and
    :class:`OwnBytes` as they are."""
    seen, total, stack = set(), 0, list(objects)
    while stack:
        item = stack.pop()
        if isinstance(item, OwnBytes):
            total += int(item)
        elif hasattr(item, "parameters") and hasattr(item, "buffers"):
            stack.extend([*item.parameters(), *item.buffers()])
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "element_size") and hasattr(item, "numel") and hasattr(item, "data_ptr"):
            key = (item.data_ptr(), item.numel())
            if key not in seen:
                seen.add(key)
                total += object_bytes(item)
    return total


class DraftMemory:
    """A draft in memory as a holder (kind ``draft``): the tensors of what ``objects()`` returns
    (its served model, its learner's candidate and optimizer state), measured at most once a
    second (they change only when an update hands over). Never sheds: content routing bounds how
    many drafts are in memory. A llama.cpp draft's weights live in llama.cpp and are not counted."""

    memory_kind = "draft"

    def __init__(self, name: str, objects: Callable[[], list], every: float = 1.0) -> None:
        self.memory_name, self.objects, self.every = name, objects, every
        self._bytes, self._at = 0, float("-inf")

    def memory_bytes(self) -> int:
        if time.monotonic() - self._at >= self.every:
            self._bytes, self._at = tensors_bytes(self.objects()), time.monotonic()
        return self._bytes

    def shed(self, nbytes: int) -> None:
        return None


class PrefixCacheMemory:
    """A llama.cpp runner's prefix cache as a holder (kind ``prefix_cache``): the KV cells its
    entries hold, at ``cell_bytes`` each (:mod:`onlinespec.decoding.prefix_cache`). Never sheds
    here: the cache evicts least recently used entries past its own budget (``--prefix-cache-cells``),
    and the cells live in llama.cpp's context, allocated when the server starts."""

    memory_kind = "prefix_cache"

    def __init__(self, name: str, cache, cell_bytes: int) -> None:
        self.memory_name, self.cache, self.cell_bytes = name, cache, cell_bytes

    def memory_bytes(self) -> int:
        return self.cache.cells * self.cell_bytes

    def shed(self, nbytes: int) -> None:
        return None


_BUDGET = MemoryBudget(default_limit())


def budget() -> MemoryBudget:
    """The process's budget (what holders register with unless given their own)."""
    return _BUDGET


def configure(limit: int | None = None, on_event: Callable[[dict], None] | None = None) -> MemoryBudget:
    """Set the process's budget (the server's ``--memory-budget``) and where its events go; the
    holders already registered stay, and the new limit is enforced now."""
    if limit is not None:
        if limit < 1:
            raise ValueError(f"a memory budget must be positive, got {limit}")
        _BUDGET.limit = int(limit)
    if on_event is not None:
        _BUDGET.on_event = on_event
    _BUDGET.check()
    return _BUDGET
