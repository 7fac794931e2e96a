"""The target's KV cache for a batch of requests of different lengths: rows with holes.

Every step appends one block of ``W`` columns to every row (``W``: the widest verification block
of the step; narrower blocks are padded with throw-away tokens). Acceptance then cuts each request
at its own point, and the columns it did not keep (rejected proposals, padding) stay where they are
as *holes*: the row's ``valid`` mask says which columns are real tokens, and every forward attends
only to those. A request's positions (RoPE) count its real tokens only, so holes change nothing a
request computes: its logits are those of the same tokens run alone, up to the last bits of
floating-point sums. When the holes grow to half the cache, :meth:`BatchKVCache.compact` moves
every row's real columns to the right, leaving one aligned block of real columns per row.

Why this design, and not per-request caches stacked per step or a paged cache
(``docs/engine.md``): stacking copies every request's whole cache on every step; pages need an
attention kernel that reads them, which the Hugging Face models we run do not have on a CPU.
Holes cost attention over a few masked columns, and the buffers are preallocated, so appending a
block writes ``W`` columns in place instead of copying the cache (the default ``DynamicCache``
concatenates, which at batch 8 and 400 tokens of context moves ~150 MB per step).

A request joins with a cache of its own (its prompt, prefilled alone: :meth:`add`); leaving drops
its row (:meth:`remove`).
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache, DynamicLayer

MIN_CAPACITY = 64


def cache_arg(module: torch.nn.Module, cache: DynamicCache) -> dict:
    """``{keyword: cache}`` for ``module``'s forward: transformers' recent releases call the KV cache
    argument ``cache``, earlier 5.x releases ``past_key_values``. A forward given the other name
    swallows it in ``**kwargs`` and runs without the cache (silently wrong logits), so every call
    that passes a cache goes through here."""
    return {_cache_keyword(type(module).forward): cache}


@functools.cache
def _cache_keyword(forward) -> str:
    parameters = inspect.signature(forward).parameters
    if "cache" in parameters:
        return "cache"
    if "past_key_values" in parameters:
        return "past_key_values"
    raise TypeError(f"{forward.__qualname__} takes no KV cache argument (neither 'cache' nor 'past_key_values')")


class _SlotLayer(DynamicLayer):
    """One layer's keys and values in a preallocated buffer ``[B, H, capacity, D]``, filled up to
    ``used``; :meth:`update` writes the new columns in place (growing the buffer by doubling)."""

    def __init__(self) -> None:
        super().__init__()
        self.k_buffer: torch.Tensor | None = None
        self.v_buffer: torch.Tensor | None = None
        self.used = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    def set(self, keys: torch.Tensor, values: torch.Tensor, capacity: int | None = None) -> None:
        """Replace the contents with ``keys`` / ``values`` ``[B, H, L, D]``."""
        batch, heads, length, dim = keys.shape
        capacity = max(capacity or 0, length, MIN_CAPACITY)
        self.k_buffer = keys.new_empty(batch, heads, capacity, dim)
        self.v_buffer = values.new_empty(batch, heads, capacity, dim)
        self.k_buffer[:, :, :length] = keys
        self.v_buffer[:, :, :length] = values
        self.used, self.device, self.is_initialized = length, keys.device, True
        self._expose()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        width = key_states.shape[-2]
        if self.k_buffer is None:
            self.set(key_states, value_states, capacity=2 * width)
            return self.keys, self.values
        if self.used + width > self.k_buffer.shape[-2]:
            capacity = max(2 * self.k_buffer.shape[-2], self.used + width)
            self.set(self.k_buffer[:, :, : self.used], self.v_buffer[:, :, : self.used], capacity)
        self.k_buffer[:, :, self.used: self.used + width] = key_states
        self.v_buffer[:, :, self.used: self.used + width] = value_states
        self.used += width
        self._expose()
        return self.keys, self.values

    def _expose(self) -> None:
        self.keys, self.values = self.k_buffer[:, :, : self.used], self.v_buffer[:, :, : self.used]

    def get_seq_length(self) -> int:
        return self.used

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.used + query_length, 0


class BatchKVCache:
    """The target's cache for the running requests, one row each, in the order of ``rows``.

    ``valid[b, j]``: column ``j`` of row ``b`` holds a real token; ``lengths[b]``: how many
    (the request's next position). ``cache`` is what the model's forward takes.
    """

    def __init__(self, config, device: torch.device | str | None = None) -> None:
        self.config, self.device = config, torch.device(device or "cpu")
        self.cache = DynamicCache(config=config)
        self.cache.layers = [_SlotLayer() for _ in self.cache.layers]
        self.rows: list[object] = []
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.lengths: list[int] = []

    @property
    def width(self) -> int:
        """Columns per row, holes included (what attention runs over)."""
        return self.valid.shape[1]

    # ---- one step ----------------------------------------------------------------------------

    def inputs(self, blocks: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``input_ids``, ``position_ids`` ``[B, width]`` and the additive attention mask
        ``[B, 1, width, L + width]`` for one block per row (in row order), padded to ``width``;
        an empty block is all padding (the row sits the step out: it keeps no column)."""
        if len(blocks) != len(self.rows):
            raise ValueError(f"one block per row: {len(blocks)} blocks for {len(self.rows)} rows")
        batch = len(blocks)
        input_ids = torch.tensor([block + (block[-1:] or [0]) * (width - len(block)) for block in blocks])  # [] sits out: all padding
        positions = torch.tensor(self.lengths).unsqueeze(1) + torch.arange(width)
        new = torch.arange(width)
        causal = new.unsqueeze(1) >= new.unsqueeze(0)  # [width, width]
        allowed = torch.cat([self.valid.unsqueeze(1).expand(batch, width, self.width), causal.expand(batch, width, width)], -1)
        dtype = next(iter(self._dtypes()), torch.float32)
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        return input_ids.to(self.device), positions.to(self.device), mask.unsqueeze(1).to(self.device)

    def commit(self, width: int, kept: list[int]) -> None:
        """After a forward over blocks of ``width``: row ``b`` keeps its first ``kept[b]`` new
        columns as real tokens; the rest become holes."""
        batch = len(self.rows)
        new_valid = torch.arange(width).unsqueeze(0) < torch.tensor(kept).unsqueeze(1)
        self.valid = torch.cat([self.valid.reshape(batch, -1), new_valid], 1)
        self.lengths = [length + n for length, n in zip(self.lengths, kept)]
        if self.width > MIN_CAPACITY and self.width > 2 * max(self.lengths):
            self.compact()

    def rewind(self, width: int) -> None:
        """Forget the last ``width`` columns, as if the last forward had not run (calibration)."""
        for layer in self.cache.layers:
            layer.used -= width
            layer._expose()

    # ---- joining, leaving, compacting -----------------------------------------------------

    @classmethod
    def filled(cls, config, cache: DynamicCache, rows: list[object]) -> "BatchKVCache":
        """A batch cache holding ``cache``'s rows as they are (every column real)."""
        batch = cls(config, cache.layers[0].keys.device)
        length = cache.get_seq_length()
        for layer, source in zip(batch.cache.layers, cache.layers):
            layer.set(source.keys, source.values, capacity=2 * length)
        batch.rows, batch.lengths = list(rows), [length] * len(rows)
        batch.valid = torch.ones(len(rows), length, dtype=torch.bool)
        return batch

    def add(self, row: object, cache: DynamicCache) -> None:
        """A request joins with its own cache (every column real). Rows are aligned on the right:
        the shorter side gets holes on the left."""
        length = cache.get_seq_length()
        keys = [(layer.keys, layer.values) for layer in cache.layers]
        if not self.rows:
            for layer, (k, v) in zip(self.cache.layers, keys):
                layer.set(k, v, capacity=2 * length)
            self.rows, self.lengths = [row], [length]
            self.valid = torch.ones(1, length, dtype=torch.bool)
            return
        total = max(self.width, length)
        for layer, (k, v) in zip(self.cache.layers, keys):
            old_k, old_v = _left_pad(layer.keys, total), _left_pad(layer.values, total)
            layer.set(torch.cat([old_k, _left_pad(k, total)]), torch.cat([old_v, _left_pad(v, total)]), layer.k_buffer.shape[-2])
        valid = torch.ones(1, length, dtype=torch.bool)
        self.valid = torch.cat([_left_pad(self.valid, total), _left_pad(valid, total)])
        self.rows.append(row)
        self.lengths.append(length)

    def remove(self, rows: list[object]) -> None:
        """Drop the rows of requests that left."""
        keep = [i for i, row in enumerate(self.rows) if row not in rows]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        if not keep:
            self.__init__(self.config, self.device)
            return
        index = torch.tensor(keep, device=self.device)
        self.valid = self.valid[index.cpu()]
        self._rebuild([index] * len(self.cache.layers))

    def compact(self) -> None:
        """Move every row's real columns to the right end, in order; drop columns no row uses."""
        total = max(self.lengths)
        order = torch.argsort(self.valid.to(torch.int8), dim=1, stable=True)[:, -total:]  # holes first, then real
        on_device = order.to(self.device)
        gathers = []
        for layer in self.cache.layers:
            index = on_device[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            gathers.append(index)
        for layer, index in zip(self.cache.layers, gathers):
            layer.set(layer.keys.gather(2, index), layer.values.gather(2, index), layer.k_buffer.shape[-2])
        self.valid = self.valid.gather(1, order)

    def _rebuild(self, indices: list[torch.Tensor]) -> None:
        for layer, index in zip(self.cache.layers, indices):
            layer.set(layer.keys[index], layer.values[index], layer.k_buffer.shape[-2])
        used = self.valid.any(0)
        first = int(used.float().argmax()) if used.any() else self.width
        if first:  # columns that are holes in every remaining row
            for layer in self.cache.layers:
                layer.set(layer.keys[:, :, first:], layer.values[:, :, first:], layer.k_buffer.shape[-2])
            self.valid = self.valid[:, first:]

    def _dtypes(self):
        return (layer.k_buffer.dtype for layer in self.cache.layers if layer.k_buffer is not None)


def _left_pad(x: torch.Tensor, total: int) -> torch.Tensor:
    """Pad dimension -2 (cache columns) or -1 (a valid mask) on the left to ``total``: holes."""
    dim = -1 if x.dim() == 2 else -2
    missing = total - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim)


def forward(model, batch: BatchKVCache, blocks: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over one block per row of ``batch``, padded to ``width``: the logits of every
    block's tokens, rows concatenated in row order ``[sum(len(block)), V]``, and the post-norm
    hidden states they came from (None for a model with only a causal-LM forward). The output
    head (a large share of a forward) runs only on those rows, never on the padding."""
    input_ids, positions, mask = batch.inputs(blocks, width)
    sizes = [len(block) for block in blocks]
    if not hasattr(model, "get_decoder"):  # a model that only has a causal-LM forward
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **cache_arg(model, batch.cache)).logits
        return torch.cat([logits[b, :n] for b, n in enumerate(sizes)]), None
    decoder = model.get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=mask, position_ids=positions, **cache_arg(decoder, batch.cache)).last_hidden_state
    picked = torch.cat([hidden[b, :n] for b, n in enumerate(sizes)])
    return model.get_output_embeddings()(picked), picked
