"""The llama.cpp backend: the target's GGUF file as shipped, run by llama.cpp.

CPU decoding is bound by memory traffic: the packaged Q4_1 target moves about 98 MB of weights a
step here, where its fp32 copy in PyTorch moves about 540 MB. This runner calls llama.cpp's C API
through llama-cpp-python's ctypes bindings (``docs/backends.md`` says why that binding):

- one context for the engine, one sequence id per request (``n_seq_max`` = the engine's batch),
  each sequence with a KV cache of its own (:data:`KV_UNIFIED` off: a request's results never
  depend on where another's cells sit, and attention never runs over other requests' cells);
- ``forward`` is ONE ``llama_decode`` over every running request's block, each token with its
  request's sequence id and position (continuous batching, no padding: llama.cpp needs none).
  llama.cpp computes a run of consecutive sequence ids as one graph, so a request takes the
  lowest free id and the blocks go to llama.cpp in id order (rows in the engine's order, ids as
  requests came and went, had run a graph per row: ``bench/batch_cost.py``);
- ``commit`` removes each request's rejected positions with ``llama_memory_seq_rm`` (checked: it
  fails on caches that cannot drop a partial sequence, e.g. recurrent models);
- the context has embeddings on with no pooling, so one decode returns both the logits and the
  final post-norm hidden state of every output position: the feature head and the recorder
  read the same features as on the torch backend;
- flash attention stays llama.cpp's default (:data:`FLASH_ATTENTION`, on for a CPU): off is
  faster at long contexts here, but it makes a verified row's logits depend on its block's
  width (docs/engine.md, "Attention at long contexts").

Prompts longer than ``n_batch`` tokens are decoded in pieces of ``n_batch``.

With a prefix cache (:mod:`onlinespec.decoding.prefix_cache`), a request that ends leaves its
sequence's cells as a cache entry instead of clearing them; the context then has sequences beyond
the batch's (one per ``context`` cells of the cache's budget), so cached cells never take a live
request's room, and a new request takes a free sequence, or the least recently used entry's.
"""

from __future__ import annotations

import heapq
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from onlinespec import memory
from onlinespec.decoding.prefix_cache import PrefixCache

DEFAULT_CONTEXT = 4096  # tokens per request unless asked (the KV cache is allocated up front, per request)
N_BATCH = 512  # tokens per llama_decode call
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: sequences one context may have
# llama.cpp's flash_attn_type for the engine's context: its own default (on, for a CPU). Off was
# measured here (bench/attention_cost.py, docs/results/attention_cost.json) up to 1.8x faster for a
# block of several tokens at a long context, but its batched attention made a row's logits depend
# on the block's width: greedy output under 30 JSON schemas left the target alone's at a near-tie
# on 14 of 30 (docs/engine.md, "Attention at long contexts"). On, a row's attention is its own,
# and a Q4_1 file's rows are computed alike at every width.
FLASH_ATTENTION = "auto"
# A KV cache stream per sequence (false), or one cache for all (true). With streams llama.cpp splits
# a batch into micro-batches of consecutive sequence ids with the same number of tokens each, one
# graph each (hence forward's id order). Unified runs every batch as one graph, but a row's
# attention then sums its cells in the order they sit among the others' (flash attention keeps
# partial sums in f16): greedy output at 4 in flight left the target alone's on 5 of 12 prompts
# (near-ties) where streams leave it on at most 1, and it served no faster here (docs/engine.md,
# "One graph a step"). bench/batch_cost.py measures both.
KV_UNIFIED = False


class LlamaCppError(RuntimeError):
    """llama.cpp refused a call (no KV room, a failed decode, a model it cannot load)."""


def _bindings():
    try:
        import llama_cpp
    except ImportError as err:  # pragma: no cover - make setup installs it
        raise LlamaCppError("the llama.cpp backend needs llama-cpp-python: `pip install llama-cpp-python==0.3.36` "
                            "(or run `make setup`), or serve with --backend torch") from err
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its C log callback prints below ERROR otherwise
    return llama_cpp


def cpu_threads() -> int:
    """The cores this process may run on (llama.cpp's own default is 4, whatever the machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclass
class LlamaCppModel:
    """A GGUF file loaded by llama.cpp once: the weights every context of this process shares."""

    path: Path
    pointer: object
    n_vocab: int
    n_embd: int
    n_ctx_train: int
    eos_token_ids: frozenset[int]

    @classmethod
    def load(cls, path: str | os.PathLike[str], n_gpu_layers: int = 0, mmap: bool = True) -> "LlamaCppModel":
        """``n_gpu_layers``: layers a GPU build of llama.cpp offloads (llama.cpp's -ngl; -1: all; a CPU build ignores it).
        ``mmap`` False reads the weights instead of mapping the file (llama.cpp's --no-mmap): the
        weights llama.cpp repacks for its CPU kernels are copied either way, and a mapping keeps
        the file's pages of them resident beside the copy (on the 1.5B: 2.08 GB resident mapped,
        1.49 GB read)."""
        lib = _bindings()
        path = Path(path)
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        if not mmap:
            params.load_mode = lib.LLAMA_LOAD_MODE_NONE
        pointer = lib.llama_model_load_from_file(str(path).encode(), params)
        if not pointer:
            raise LlamaCppError(f"llama.cpp could not load {path}: is it a GGUF file of a model llama.cpp supports?")
        vocab = lib.llama_model_get_vocab(pointer)
        eos = {lib.llama_vocab_eos(vocab), lib.llama_vocab_eot(vocab)} - {-1}
        return cls(path, pointer, lib.llama_vocab_n_tokens(vocab), lib.llama_model_n_embd(pointer),
                   lib.llama_model_n_ctx_train(pointer), frozenset(eos))

    def __del__(self) -> None:
        try:
            _bindings().llama_model_free(self.pointer)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class LlamaCppRunner:
    """The engine's runner on llama.cpp (the protocol: :mod:`onlinespec.decoding.runners`)."""

    name = "llama.cpp"
    idle_rows_free = True  # a row without tokens in the step is simply not in llama.cpp's batch

    def __init__(self, model: LlamaCppModel, max_rows: int = 8, context: int | None = None,
                 threads: int | None = None, n_batch: int = N_BATCH, prefix_cache: bool = False,
                 prefix_cache_cells: int | None = None) -> None:
        """``max_rows``: requests held at once (running and prefilling); ``context``: tokens per
        request (default: the model's training context, at most :data:`DEFAULT_CONTEXT`);
        ``prefix_cache``: keep finished requests' cells for new prompts that begin the same way,
        at most ``prefix_cache_cells`` of them (default: one request's context)."""
        self._lib = lib = _bindings()
        self.model, self.max_rows, self.n_batch = model, max_rows, n_batch
        self._context = min(context or DEFAULT_CONTEXT, model.n_ctx_train or DEFAULT_CONTEXT)
        self.threads = threads or cpu_threads()
        self.prefix_cache = PrefixCache(prefix_cache_cells or self._context) if prefix_cache else None
        # the cache's own sequences (idle batch sequences hold entries too, until a request needs them)
        extra = -(-self.prefix_cache.budget // self._context) if self.prefix_cache else 0
        if max_rows + extra > MAX_SEQUENCES:
            raise LlamaCppError(f"{max_rows} requests and a prefix cache of {prefix_cache_cells} cells need {max_rows + extra} llama.cpp "
                                f"sequences of {self._context} cells, past llama.cpp's {MAX_SEQUENCES}: lower --prefix-cache-cells")
        self.sequences = max_rows + extra
        params = lib.llama_context_default_params()
        params.n_ctx = self._context * self.sequences
        params.n_seq_max = self.sequences
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = self.threads
        params.embeddings = True
        params.pooling_type = lib.LLAMA_POOLING_TYPE_NONE
        params.kv_unified = KV_UNIFIED
        params.flash_attn_type = getattr(lib, f"LLAMA_FLASH_ATTN_TYPE_{FLASH_ATTENTION.upper()}")
        self._ctx = lib.llama_init_from_model(model.pointer, params)
        if not self._ctx:
            raise LlamaCppError(f"llama.cpp could not make a context of {self.sequences} x {self._context} tokens for "
                                f"{model.path.name}: lower --max-batch, --prefix-cache-cells or the context")
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(n_batch, 0, 1)
        self._rows: list[object] = []
        self._seq: dict[int, int] = {}  # id(request) -> its sequence id
        self._length: dict[int, int] = {}  # id(request) -> positions in its cache
        self._tokens: dict[int, list[int]] = {}  # id(request) -> the tokens its cache holds, in order
        self._held: dict[int, object] = {}  # id(request) -> request
        self._free = list(range(self.sequences))  # a heap: a request takes the lowest free id (_acquire)
        self._last: list[int] = []  # the last forward's block sizes (rewind)
        self._embeddings = True  # the context's embeddings switch (see _decode)
        if self.prefix_cache is not None:  # its cells count in the process's memory budget (onlinespec.memory)
            self._prefix_memory = memory.PrefixCacheMemory(model.path.name, self.prefix_cache, self.cell_bytes)
            memory.budget().register(self._prefix_memory)  # (held weakly there: this runner keeps it)

    def __del__(self) -> None:
        try:
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ctx)
        except Exception:  # noqa: BLE001 - interpreter shutdown, or a failed __init__
            pass

    # ---- what the engine reads ----------------------------------------------------------------

    @property
    def context(self) -> int:
        return self._context

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    @property
    def cell_bytes(self) -> int:
        """Bytes one KV cell takes (one token of one sequence: keys and values, f16, every layer)."""
        lib, model = self._lib, self.model.pointer
        head_dim = lib.llama_model_n_embd(model) // max(lib.llama_model_n_head(model), 1)
        return 2 * lib.llama_model_n_layer(model) * lib.llama_model_n_head_kv(model) * head_dim * 2

    @property
    def rows(self) -> list[object]:
        return self._rows

    @property
    def columns(self) -> int:
        return max((self._length[id(r)] for r in self._rows), default=0)

    def holding(self) -> list[object]:
        return list(self._held.values())

    # ---- forwards -----------------------------------------------------------------------------

    def prefill(self, request: object, tokens: list[int]) -> None:
        self._extend(request, tokens, 0)

    def forward_alone(self, request: object, block: list[int], keep: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._extend(request, block, keep)

    def join(self, request: object, length: int) -> None:
        self.truncate(request, length)
        self._rows.append(request)

    def fork(self, donor: object, request: object, length: int) -> bool:
        """Start ``request``'s cache with the first ``length`` positions of ``donor``'s (a prompt
        both begin with), copied rather than computed; False when that cannot be done here."""
        if id(donor) not in self._held or self._length[id(donor)] < length or id(request) in self._held:
            return False
        self._acquire(request)
        key = id(request)
        # sequences have streams of their own (KV_UNIFIED off): llama.cpp copies a whole stream, then the copy is cut
        self._lib.llama_memory_seq_cp(self._memory, self._seq[id(donor)], self._seq[key], -1, -1)
        self._length[key], self._tokens[key] = self._length[id(donor)], list(self._tokens[id(donor)])
        self.truncate(request, length)
        return True

    def reuse(self, request: object, prompt: list[int], least: int = 1) -> int | None:
        """Start a new ``request``'s cache with the longest prefix of ``prompt`` (at most all but
        its last token) that a cache entry of the request's key (``request.cache_key``) holds, when
        at least ``least`` tokens: the entry's cells copied into the request's sequence
        (``llama_memory_seq_cp``), or the entry's sequence itself when no other is free. Returns
        the positions reused (0: none); None when this runner keeps no prefix cache."""
        cache, key = self.prefix_cache, getattr(request, "cache_key", None)
        if cache is None or key is None:
            return None
        entry, length = cache.lookup(key, prompt)
        if entry is None or length < least or id(request) in self._held:
            return 0
        if self._make_free(keep=entry):
            self._acquire(request)
            self._lib.llama_memory_seq_cp(self._memory, entry.seq, self._seq[id(request)], -1, -1)
        else:  # every other sequence is a live request's: this one takes the entry's own
            self._seq[id(request)], self._held[id(request)] = cache.take(entry), request
        self._length[id(request)], self._tokens[id(request)] = len(entry.tokens), entry.tokens.tolist()
        self.truncate(request, length)
        return length

    def purge_prefix(self, owner: str | None = None, before: float | None = None) -> int:
        """Drop the cache entries made by request ``owner`` (or before the Unix time ``before``);
        return the cells dropped."""
        if self.prefix_cache is None:
            return 0
        held = self.prefix_cache.cells
        for seq in self.prefix_cache.purge(owner, before):
            self._clear(seq)
        return held - self.prefix_cache.cells

    def forward(self, blocks: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        if len(blocks) != len(self._rows):
            raise ValueError(f"one block per row: {len(blocks)} blocks for {len(self._rows)} rows")
        sizes = [len(block) for block in blocks]  # 0: the row sits the step out
        if not any(sizes):
            raise ValueError("a step needs at least one row with a block")
        if sum(sizes) > self.n_batch:
            raise LlamaCppError(f"a step of {sum(sizes)} tokens exceeds llama.cpp's batch of {self.n_batch}")
        # in sequence-id order: llama.cpp runs each run of consecutive ids as one graph (KV_UNIFIED)
        order = sorted(range(len(blocks)), key=lambda i: self._seq[id(self._rows[i])])
        logits, hidden = self._decode([(self._seq[id(self._rows[i])], self._length[id(self._rows[i])], blocks[i], sizes[i]) for i in order])
        logits, hidden = logits.split([sizes[i] for i in order]), hidden.split([sizes[i] for i in order])
        back = sorted(range(len(order)), key=order.__getitem__)  # each row's place in the decoded batch
        for r, block in zip(self._rows, blocks):
            self._length[id(r)] += len(block)
            self._tokens[id(r)].extend(block)
        self._last = sizes
        return [logits[j] for j in back], [hidden[j] for j in back]

    def commit(self, kept: list[int]) -> None:
        for r, size, n in zip(self._rows, self._last, kept):
            self.truncate(r, self._length[id(r)] - size + n)

    def rewind(self) -> None:
        self.commit([0] * len(self._rows))

    # ---- what requests hold -------------------------------------------------------------------

    def release(self, requests: list[object]) -> None:
        """Free what ``requests`` hold; with a prefix cache, the cells of one that did not fail
        stay as a cache entry under its key (``request.cache_key``)."""
        for request in requests:
            key = id(request)
            if key not in self._held:
                continue
            seq, tokens = self._seq.pop(key), self._tokens.pop(key)
            del self._length[key], self._held[key]
            cache_key = getattr(request, "cache_key", None)
            if self.prefix_cache is None or cache_key is None or getattr(request, "error", None) is not None or len(tokens) < 2:
                self._clear(seq)
                continue
            for freed in self.prefix_cache.add(cache_key, tokens, seq, getattr(request, "cache_owner", None)):
                self._clear(freed)
        gone = {id(r) for r in requests}
        self._rows = [r for r in self._rows if id(r) not in gone]

    def reset(self) -> None:
        self._lib.llama_memory_clear(self._memory, True)
        self._rows, self._seq, self._length, self._tokens, self._held = [], {}, {}, {}, {}
        self._free = list(range(self.sequences))
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    # ---- llama.cpp calls ----------------------------------------------------------------------

    def _acquire(self, request: object) -> None:
        key = id(request)
        if key in self._held:
            return
        if not self._make_free():
            raise LlamaCppError(f"all {self.max_rows} llama.cpp sequences are in use: the engine ran more requests than its batch")
        self._seq[key], self._length[key], self._tokens[key], self._held[key] = heapq.heappop(self._free), 0, [], request

    def _make_free(self, keep: object = None) -> bool:
        """Whether a sequence is free, evicting the least recently used cache entry (not ``keep``) if need be."""
        if not self._free and self.prefix_cache is not None:
            seq = self.prefix_cache.evict(keep)
            if seq is not None:
                self._clear(seq)
        return bool(self._free)

    def _clear(self, seq: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, seq, -1, -1)  # a whole sequence: never fails
        heapq.heappush(self._free, seq)

    def _extend(self, request: object, tokens: list[int], keep: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Append ``tokens`` to one request's cache, in pieces of at most ``n_batch`` (the outputs
        in pieces of their own); the logits and hidden states of the last ``keep`` (None when 0)."""
        self._acquire(request)
        key = id(request)
        last = len(tokens) - keep  # the tokens before the outputs: no logits, no hidden states
        pieces = [(tokens[start: min(start + self.n_batch, last)], False) for start in range(0, last, self.n_batch)]
        pieces += [(tokens[start: start + self.n_batch], True) for start in range(last, len(tokens), self.n_batch)]
        outs = []
        for piece, outputs in pieces:
            out = self._decode([(self._seq[key], self._length[key], piece, len(piece) if outputs else 0)])
            self._length[key] += len(piece)
            self._tokens[key].extend(piece)
            if out is not None:
                outs.append(out)
        if len(outs) < 2:
            return outs[0] if outs else None
        return torch.cat([logits for logits, _ in outs]), torch.cat([hidden for _, hidden in outs])

    def truncate(self, request: object, length: int) -> None:
        """Keep the first ``length`` positions of ``request``'s cache (a row's after a verification, a draft's)."""
        key = id(request)
        if length < self._length[key]:
            if not self._lib.llama_memory_seq_rm(self._memory, self._seq[key], length, -1):
                raise LlamaCppError(f"llama.cpp could not remove rejected tokens from {self.model.path.name}'s cache "
                                    "(a recurrent or sliding-window model?): serve it with --backend torch")
            self._length[key] = length
            del self._tokens[key][length:]

    def _decode(self, entries: list[tuple[int, int, list[int], int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One ``llama_decode``: per entry (sequence, first position, tokens, how many of its last
        tokens to output). Returns the outputs' logits ``[n, V]`` and hidden states ``[n, H]``."""
        batch, i = self._batch, 0
        for seq, position, tokens, outputs in entries:
            first_out = len(tokens) - outputs
            for j, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position + j, 1
                batch.seq_id[i][0], batch.logits[i] = seq, j >= first_out
                i += 1
        batch.n_tokens = i
        n = sum(outputs for *_, outputs in entries)
        # with embeddings on, llama.cpp outputs every token of the batch: the output head would run
        # over a whole prompt chunk; a chunk without outputs runs with embeddings off
        if self._embeddings != bool(n):
            self._lib.llama_set_embeddings(self._ctx, bool(n))
            self._embeddings = bool(n)
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise LlamaCppError(f"llama_decode failed with status {status} on {i} tokens"
                                + (" (no room left in the KV cache)" if status == 1 else ""))
        if n == 0:
            return None
        logits = np.ctypeslib.as_array(self._lib.llama_get_logits(self._ctx), shape=(n, self.model.n_vocab))
        hidden = np.ctypeslib.as_array(self._lib.llama_get_embeddings(self._ctx), shape=(n, self.model.n_embd))
        return torch.from_numpy(logits.copy()), torch.from_numpy(hidden.copy())  # llama.cpp reuses its buffers
