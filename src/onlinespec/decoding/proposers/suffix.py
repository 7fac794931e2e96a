"""A suffix index over earlier requests: the target's verified outputs (and their prompts) as a
model-free draft that learns from every request at zero target cost.

The idea is Snowflake Arctic's suffix decoding (Oliaro et al., 2024, arXiv 2411.04975): what a
target said before, it tends to say again (the opening of its answers, its code idioms, the
steps of a worked maths problem in every language). Find the longest suffix of the current text
that occurred in earlier requests, and propose what most often followed it.

The structure. A suffix tree answers two questions: how long is the longest earlier occurrence
of the current suffix, and how often was each continuation seen after it. We answer both with an
anchor index, which keeps the lookups and makes eviction cheap:

- the corpus is every indexed request's tokens, concatenated in arrival order (a separator
  between requests) in one int32 array;
- ``anchors`` maps each ``ANCHOR``-gram (two tokens) to the corpus positions that follow its
  occurrences, ascending;
- a lookup takes the positions after the current text's last two tokens (the newest
  ``max_candidates``), extends every match backwards up to ``max_match`` tokens in one vectorised
  comparison, keeps the candidates with the longest match (the suffix tree's deepest node), and
  walks their continuations greedily: at each step the most frequent next token (ties: the
  newest), the candidates that disagree dropped. The conditional frequency of each step, shrunk
  by the evidence behind it (``count / (n + 1)``), is the proposal's confidence, which the
  engine's adaptive k calibrates against measured acceptance.

A suffix tree (or automaton) would find matches of any length in time independent of the corpus,
but deleting the oldest request from one is a rebuild, and each node costs tens of bytes per
corpus token in Python. Here memory is the corpus (4 bytes a token) plus one 8-byte anchor entry
per token (``max_tokens`` bounds both), eviction of the oldest requests is a moving ``base`` (positions below
it are dead and skipped) with a compaction when dead entries outnumber live ones, and a request
added costs one dict append per token. Matches longer than ``max_match`` tokens gain nothing a
proposer of ``k <= 8`` tokens can use.

Privacy: a document is kept with its request id and arrival time, so a purge or retention removes
it (:meth:`purge`, :meth:`expire`); the caller never adds a request that opted out of training.
Tenants: a document belongs to a tenant, and the anchors are keyed by tenant, so a lookup for one
tenant only ever finds that tenant's documents (a match extended backwards or forwards stops at
the separator around its document). Without it, a request's proposals, and so its acceptance
figures and its speed, would tell a client which of its tokens other clients had sent: a
membership oracle (docs/reliability.md, "Tenants"). Every document of tenant ``""`` is shared by
all who look up ``""``.
Thread-safe: one lock around every read and write (a lookup takes under 0.1 ms).

Memory: ``max_tokens`` bounds one index; the process's memory budget (:mod:`onlinespec.memory`)
bounds all of them together, whatever the number of tenants. :meth:`memory_bytes` is the corpus'
``nbytes``, the anchor dict's ``sys.getsizeof`` and, counted as they are made, each anchor's key
(its tuple and int objects) and array (``sys.getsizeof`` once made, 8 bytes a position after),
and each document's record (tests/test_memory_budget.py checks it against tracemalloc). Over its
share, an index sheds (:meth:`shed`) the documents of its least-recently-used tenant (the one
whose last lookup or request is oldest), oldest first, then the next tenant's.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onlinespec.decoding.proposal import DraftInput, Proposal
from onlinespec.decoding.proposers.base import PerRequestProposer
from onlinespec.decoding.proposers.ngram import copy_proposal

ANCHOR = 2  # tokens every match starts from (a key of the anchor index)
SEPARATOR = -1  # between documents in the corpus: never a token, so no match crosses a request
FORMAT = "onlinespec-suffix-index/1"


_KEY_BYTES = sys.getsizeof(("", 0, 0)) + 2 * sys.getsizeof(2**20)  # an anchor's key: its tuple and two int objects
_ARRAY_BYTES = sys.getsizeof(array("q", [0]))  # a new anchor's array, its first position included


class IdentityMismatch(ValueError):
    """A saved index was made with another tokenizer: its token ids mean other words here."""


@dataclass(slots=True)
class _Doc:
    start: int  # global position of its first token in the corpus
    length: int
    request_id: str
    created_at: float
    tenant: str = ""


# a document's record: the _Doc, its two int objects and its float (its request id is counted apart)
_DOC_BYTES = sys.getsizeof(_Doc(0, 0, "", 0.0)) + 2 * sys.getsizeof(2**20) + sys.getsizeof(0.5)


@dataclass(frozen=True)
class SuffixMatch:
    tokens: list[int]
    confidences: list[float]
    match_length: int  # tokens of the current text matched before the proposal
    support: int  # earlier occurrences of that match


class SuffixIndex:
    def __init__(self, max_tokens: int = 500_000, max_match: int = 8, max_candidates: int = 256,
                 clock: Callable[[], float] = time.time) -> None:
        if max_tokens < 1 or max_match < ANCHOR or max_candidates < 1:
            raise ValueError(f"need max_tokens >= 1, max_match >= {ANCHOR}, max_candidates >= 1; got "
                             f"{max_tokens}, {max_match}, {max_candidates}")
        self.max_tokens, self.max_match, self.max_candidates = max_tokens, max_match, max_candidates
        self.clock = clock
        self.identity = ""  # the tokenizer's fingerprint, saved with the index and checked on load
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()  # held from snapshot to rename: saves land in the order they were taken
        self._clear()
        self._generation = 0  # bumped by every change; a save clears `dirty` only if none came since its snapshot
        self.dirty = False  # changed since the last save
        self.counts = {"added": 0, "evicted": 0, "expired": 0, "purged": 0}
        self.memory_kind, self.memory_name = "suffix_index", ""
        self.budget = None  # the memory budget it counts against (set by whoever keeps it: SuffixFiles)
        self._recent: OrderedDict[str, None] = OrderedDict()  # tenants, least recently used first

    def _clear(self) -> None:
        self._docs: OrderedDict[int, _Doc] = OrderedDict()  # keyed by start, oldest first
        self._chunks: list[np.ndarray] = []  # appended documents not yet folded into _corpus
        self._chunk_bytes = 0  # their nbytes
        self._corpus = np.empty(0, dtype=np.int32)
        self._base = 0  # global position of _corpus[0]; positions below it are evicted
        self._end = 0  # global position one past the last token
        self._anchors: dict[tuple[int, int], array] = {}  # int64 positions, ascending
        self._dead = 0  # anchor entries below _base, not yet compacted
        self._live = 0  # tokens of the documents kept
        self._held = 0  # bytes of the anchors' keys and arrays and of the documents' records, as made

    # ---- size ----------------------------------------------------------------------------

    def __len__(self) -> int:
        """Requests indexed."""
        return len(self._docs)

    @property
    def tokens(self) -> int:
        return self._live

    def memory_bytes(self) -> int:
        """Bytes held (module docstring, "Memory"): dead entries count until a compaction frees them."""
        return int(self._corpus.nbytes + self._chunk_bytes + sys.getsizeof(self._anchors) + sys.getsizeof(self._docs) + self._held)

    def shed(self, nbytes: int) -> dict | None:
        """The memory budget's eviction: documents of the least-recently-used tenant go, oldest
        first, then the next tenant's, until about ``nbytes`` are freed (one rebuild); what went."""
        with self._lock:
            held = self.memory_bytes()
            per_token, target = held / max(1, self._live), held - nbytes
            gone, tenants = [], set()
            for tenant in list(self._recent):
                for start in [s for s, d in self._docs.items() if d.tenant == tenant]:
                    if held <= target:
                        break
                    held -= per_token * self._docs[start].length
                    gone.append(start)
                    tenants.add(tenant)
                if held <= target:
                    break
            if not gone:
                return None
            for start in gone:
                del self._docs[start]
            self.counts["evicted"] += len(gone)
            self._rebuild()
            self._changed()
            return {"items": len(gone), "documents": len(gone), "tenants": len(tenants), "tenants_left": len(self._recent)}

    def _used(self, tenant: str) -> None:
        if tenant in self._recent:
            self._recent.move_to_end(tenant)

    def stats(self) -> dict:
        with self._lock:
            return {"requests": len(self._docs), "tokens": self.tokens, "max_tokens": self.max_tokens, **self.counts}

    # ---- writes --------------------------------------------------------------------------

    def add(self, tokens: Sequence[int], request_id: str = "", created_at: float | None = None, tenant: str = "") -> None:
        """Index one request's tokens (prompt + verified output), found only by lookups for its
        ``tenant``; the oldest requests go when the index is over ``max_tokens``."""
        doc = np.asarray(tokens, dtype=np.int32)
        if doc.size < ANCHOR + 1:
            return
        if doc.size > self.max_tokens:
            doc = doc[-self.max_tokens:]
        with self._lock:
            self._append(doc, request_id, self.clock() if created_at is None else created_at, tenant)
            self.counts["added"] += 1
            while self.tokens > self.max_tokens:
                self._drop_oldest("evicted")
            self._maybe_compact()
            self._changed()
        if self.budget is not None:  # outside the lock: the budget may ask this index to shed
            self.budget.check()

    def _changed(self) -> None:
        self._generation += 1
        self.dirty = True

    def _append(self, doc: np.ndarray, request_id: str, created_at: float, tenant: str = "") -> None:
        start = self._end
        self._docs[start] = _Doc(start, int(doc.size), request_id, created_at, tenant)
        self._chunks.append(np.append(doc, np.int32(SEPARATOR)))
        self._chunk_bytes += self._chunks[-1].nbytes
        self._end += doc.size + 1
        self._live += int(doc.size)
        self._recent[tenant] = None
        self._recent.move_to_end(tenant)
        ids = doc.tolist()
        anchors, made = self._anchors, 0
        for i in range(ANCHOR, len(ids)):  # the position after each anchor occurrence
            key = (tenant, ids[i - 2], ids[i - 1])
            positions = anchors.get(key)
            if positions is None:
                anchors[key] = positions = array("q")
                made += 1
            positions.append(start + i)
        entries = max(0, len(ids) - ANCHOR)
        self._held += made * (_KEY_BYTES + _ARRAY_BYTES) + (entries - made) * 8 + _DOC_BYTES + sys.getsizeof(request_id)

    def _drop_oldest(self, why: str) -> None:
        _, doc = self._docs.popitem(last=False)
        self._base = doc.start + doc.length + 1 if not self._docs else next(iter(self._docs.values())).start
        self._dead += max(0, doc.length - ANCHOR)
        self._live -= doc.length
        self.counts[why] += 1

    def _maybe_compact(self) -> None:
        live = self.tokens
        if self._dead > max(live, 10_000):
            self._rebuild()

    def _rebuild(self) -> None:
        """Rebuild the corpus and anchors from the documents kept (after a purge or an expiry,
        or once dead anchor entries outnumber live ones)."""
        corpus = self._flat()
        offset = self._end - len(corpus)
        kept = [(corpus[d.start - offset: d.start - offset + d.length], d) for d in self._docs.values()]
        recent = [t for t in self._recent if any(d.tenant == t for _, d in kept)]
        self._clear()
        for tokens, d in kept:
            self._append(tokens, d.request_id, d.created_at, d.tenant)
        self._recent = OrderedDict.fromkeys(recent)  # the order of use survives a rebuild

    def _flat(self) -> np.ndarray:
        """The corpus from ``_base`` on, pending chunks folded in."""
        if self._chunks:
            self._corpus = np.concatenate([self._corpus, *self._chunks])
            self._chunks, self._chunk_bytes = [], 0
        cut = self._base - (self._end - len(self._corpus))
        if cut > 0:
            self._corpus = self._corpus[cut:]
        return self._corpus

    def purge(self, request_id: str | None = None, before: float | None = None) -> int:
        """Forget a request's documents (or every one indexed before ``before``); how many."""
        with self._lock:
            gone = [s for s, d in self._docs.items()
                    if (request_id is not None and d.request_id == request_id) or (before is not None and d.created_at < before)]
            if gone:
                for s in gone:
                    del self._docs[s]
                self.counts["purged"] += len(gone)
                self._rebuild()  # an operator's purge: rare, and the removed tokens must leave the corpus now
                self._changed()
            return len(gone)

    def expire(self, retention_seconds: float | None) -> int:
        """Forget documents older than ``retention_seconds``: from the oldest end (documents are
        kept in arrival order), as eviction does, so the housekeeping tick never rebuilds."""
        if retention_seconds is None:
            return 0
        cutoff = self.clock() - retention_seconds
        with self._lock:
            gone = 0
            while self._docs and next(iter(self._docs.values())).created_at < cutoff:
                self._drop_oldest("expired")
                gone += 1
            if gone:
                self._maybe_compact()
                self._changed()
            return gone

    # ---- reads ---------------------------------------------------------------------------

    def match(self, ids: Sequence[int], k: int, tenant: str = "") -> SuffixMatch | None:
        """Up to ``k`` tokens that most often followed the longest earlier occurrence, among
        ``tenant``'s documents, of the end of ``ids``, with their confidences; None when the last
        two tokens never occurred there."""
        if k <= 0 or len(ids) < ANCHOR:
            return None
        with self._lock:
            self._used(tenant)
            positions = self._anchors.get((tenant, int(ids[-2]), int(ids[-1])))
            if not positions:
                return None
            corpus = self._flat()
            offset = self._end - len(corpus)
            cands = np.frombuffer(positions[-self.max_candidates:], dtype=np.int64)
            cands = cands[cands >= self._base] - offset
            if cands.size == 0:
                return None
            # Extend every match backwards: length = ANCHOR + how many earlier tokens agree too.
            tail = np.asarray(ids[-self.max_match:], dtype=np.int32)[::-1]  # tail[j]: the token j + 1 back
            length = np.full(cands.size, ANCHOR)
            alive = np.ones(cands.size, dtype=bool)
            for j in range(ANCHOR, len(tail)):
                at = cands - 1 - j
                ok = alive & (at >= 0)
                ok[ok] = corpus[at[ok]] == tail[j]
                length += ok
                alive = ok
                if not alive.any():
                    break
            best = int(length.max())
            cands = cands[length == best]
            support = int(cands.size)
            tokens: list[int] = []
            confidences: list[float] = []
            # Every document ends in a separator, and a candidate moves on only past a real token,
            # so ``cands`` always point inside the corpus: at most at their document's separator.
            for _ in range(k):
                nxt = corpus[cands]
                real = nxt[nxt != SEPARATOR]
                if real.size == 0:
                    break
                values, first_seen, counts = np.unique(real[::-1], return_index=True, return_counts=True)
                top = np.flatnonzero(counts == counts.max())
                pick = top[np.argmin(first_seen[top])]  # ties: the newest occurrence
                token = int(values[pick])
                confidences.append(float(counts[pick]) / (cands.size + 1))
                tokens.append(token)
                cands = cands[nxt == token] + 1
            return SuffixMatch(tokens, confidences, best, support) if tokens else None

    # ---- persistence ---------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the index durably and atomically (safetensors: the tokens, and per document its
        length, request id and arrival time)."""
        from safetensors.numpy import save

        from onlinespec.storage import atomic_write

        with self._save_lock:  # a purge's save never lands before an older snapshot's
            with self._lock:
                corpus = self._flat()
                offset = self._end - len(corpus)
                docs = list(self._docs.values())
                parts = [corpus[d.start - offset: d.start - offset + d.length] for d in docs]
                tensors = {
                    "tokens": np.concatenate(parts) if parts else np.empty(0, dtype=np.int32),
                    "lengths": np.asarray([d.length for d in docs], dtype=np.int64),
                    "created_at": np.asarray([d.created_at for d in docs], dtype=np.float64),
                }
                meta = {"format": FORMAT, "tokenizer": self.identity, "request_ids": json.dumps([d.request_id for d in docs]),
                        "tenants": json.dumps([d.tenant for d in docs]), "counts": json.dumps(self.counts)}
                generation = self._generation
            atomic_write(path, save(tensors, metadata=meta))  # a failed write leaves `dirty` set: the next save retries
            with self._lock:
                if self._generation == generation:
                    self.dirty = False

    def load(self, path: str | Path) -> None:
        """Replace the contents with a saved index (documents past ``max_tokens`` are evicted)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not a suffix index ({FORMAT}); move it away to start an empty one")
            if self.identity and meta.get("tokenizer") != self.identity:
                raise IdentityMismatch(f"the suffix index {path} was built with another tokenizer ({meta.get('tokenizer')!r}, "
                                       f"this run's is {self.identity!r}): give this run another --out-dir, or start it "
                                       "with the same target")
            self.identity = self.identity or meta.get("tokenizer", "")  # opened to purge a saved one: saved again with its own
            tokens, lengths, created = f.get_tensor("tokens"), f.get_tensor("lengths"), f.get_tensor("created_at")
        request_ids = json.loads(meta["request_ids"])
        tenants = json.loads(meta.get("tenants", "null")) or [""] * len(request_ids)  # saved before tenants: all shared
        if not (len(request_ids) == len(lengths) == len(created) == len(tenants) and int(lengths.sum()) == len(tokens) and (lengths >= 0).all()):
            raise ValueError(f"{path}: its documents do not add up (lengths, ids, times and tokens disagree)")
        with self._lock:
            self._clear()
            at = 0
            for length, request_id, when, tenant in zip(lengths.tolist(), request_ids, created.tolist(), tenants):
                self._append(tokens[at: at + length][-self.max_tokens:], request_id, when, tenant)
                at += length
            self.counts.update(json.loads(meta.get("counts", "{}")))
            while self.tokens > self.max_tokens:
                self._drop_oldest("evicted")
            self._maybe_compact()
            self.dirty = False


class SuffixProposer(PerRequestProposer):
    """Prompt lookup, then the suffix index over earlier requests: model-free, nothing to train.

    ``min_match``: the shortest suffix match (tokens) the index proposes from.
    """

    drafter = "suffix"  # and "ngram" for what prompt lookup copies
    free_drafts = True

    def __init__(self, index: SuffixIndex | None = None, max_ngram: int = 3, min_ngram: int = 2, min_match: int = 3) -> None:
        self.suffix_index = index or SuffixIndex()
        self.max_ngram, self.min_ngram, self.min_match = max_ngram, min_ngram, min_match
        self.name = f"suffix(ngram:{max_ngram})"

    def propose_free(self, batch: Sequence[DraftInput]) -> list[Proposal]:
        return self.propose(batch)

    def propose_one(self, d: DraftInput) -> Proposal:
        return propose_model_free(d, self.suffix_index, self.max_ngram, self.min_ngram, self.min_match) or Proposal(drafter=self.drafter)


def propose_model_free(d: DraftInput, index: SuffixIndex | None, max_ngram: int, min_ngram: int, min_match: int) -> Proposal | None:
    """The request's own text first (prompt lookup), then earlier requests (the suffix index);
    None when neither matches. Both are point masses: the exact sampler stays lossless."""
    copied = copy_proposal(np.asarray(d.ids), d.k, max_ngram, min_ngram)
    if copied is not None:
        return copied
    if index is not None and not d.params.reproducible:  # a seeded request drafts from its own text only
        found = index.match(d.ids, d.k, d.tenant)
        if found is not None and found.match_length >= min_match:
            return Proposal(tokens=found.tokens, confidences=found.confidences, drafter="suffix")
    return None
