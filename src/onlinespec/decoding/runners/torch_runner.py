"""The torch backend: a Hugging Face causal LM in PyTorch, on a CPU or a CUDA device.

The batch's cache is :class:`~onlinespec.decoding.batch_cache.BatchKVCache` (rows with holes); a
request prefills into a cache of its own and joins the batch with it. With a measured cost curve
and ``pad``, a batched block runs at the cheapest wider width (:meth:`CostCurve.padded`: on CPUs
the BLAS library picks its kernel by the number of rows).

Every input tensor is made on the model's device; logits and hidden states come back as float32
on the CPU, where verification draws with each request's own CPU generator.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PreTrainedModel

from onlinespec.decoding.batch_cache import BatchKVCache, cache_arg
from onlinespec.decoding.batch_cache import forward as batch_forward
from onlinespec.decoding.kvcache import truncate_cache

if TYPE_CHECKING:  # the cost curve's module measures runners
    from onlinespec.decoding.cost_curve import CostCurve

DEFAULT_CONTEXT = 2048  # a model config that names no context length


class TorchRunner:
    name = "torch"
    idle_rows_free = False  # a row given an empty block still computes its padding

    def __init__(self, model: PreTrainedModel, cost_curve: CostCurve | None = None, pad: bool = True,
                 context: int | None = None) -> None:
        """``context``: cap a request's positions at this many (None: the model's own context)."""
        self.model, self.cost_curve, self.pad, self._cap = model, cost_curve, pad, context
        self.device = next(model.parameters()).device
        self.batch = BatchKVCache(model.config, self.device)
        self._own: dict[int, tuple[object, DynamicCache]] = {}  # prefilling requests' caches
        self._width = 0  # the last forward's block width (padding included)

    @property
    def context(self) -> int:
        own = int(getattr(self.model.config, "max_position_embeddings", 0) or DEFAULT_CONTEXT)
        return min(own, self._cap) if self._cap else own

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def rows(self) -> list[object]:
        return self.batch.rows

    @property
    def columns(self) -> int:
        return self.batch.width

    def holding(self) -> list[object]:
        return list(self.batch.rows) + [request for request, _ in self._own.values()]

    def _cache(self, request: object) -> DynamicCache:
        if id(request) not in self._own:
            self._own[id(request)] = (request, DynamicCache(config=self.model.config))
        return self._own[id(request)][1]

    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], device=self.device)

    def prefill(self, request: object, tokens: list[int]) -> None:
        decoder = self.model.get_decoder()
        decoder(input_ids=self._ids(tokens), **cache_arg(decoder, self._cache(request)))

    def forward_alone(self, request: object, block: list[int], keep: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = self._cache(request)
        if not hasattr(self.model, "get_decoder"):  # a model with only a causal-LM forward
            return _out(self.model(input_ids=self._ids(block), logits_to_keep=keep, **cache_arg(self.model, cache)).logits[0]), None
        decoder = self.model.get_decoder()
        hidden = decoder(input_ids=self._ids(block), **cache_arg(decoder, cache)).last_hidden_state[0, -keep:]
        return _out(self.model.get_output_embeddings()(hidden)), _out(hidden)

    def fork(self, donor: object, request: object, length: int) -> bool:
        """Start ``request``'s cache with a copy of the first ``length`` positions of ``donor``'s,
        while the donor still prefills alone (its cache its own); False once it has joined the
        batch (its row lives in the batch cache among holes: ``request`` prefills its own)."""
        own = self._own.get(id(donor))
        if own is None or id(request) in self._own or own[1].get_seq_length() < length:
            return False
        cache = copy.deepcopy(own[1])
        truncate_cache(cache, length)
        self._own[id(request)] = (request, cache)
        return True

    def join(self, request: object, length: int) -> None:
        _, cache = self._own.pop(id(request))
        truncate_cache(cache, length)
        self.batch.add(request, cache)

    def forward(self, blocks: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        width = max(len(block) for block in blocks)
        if self.pad and self.cost_curve is not None:
            width = self.cost_curve.padded(len(blocks), width, self.batch.width)
        self._width = width
        logits, hidden = batch_forward(self.model, self.batch, blocks, width)
        sizes = [len(block) for block in blocks]
        return list(_out(logits).split(sizes)), list(_out(hidden).split(sizes)) if hidden is not None else None

    def commit(self, kept: list[int]) -> None:
        self.batch.commit(self._width, kept)

    def rewind(self) -> None:
        self.batch.rewind(self._width)

    def release(self, requests: list[object]) -> None:
        for request in requests:
            self._own.pop(id(request), None)
        self.batch.remove(requests)

    def reset(self) -> None:
        self._own.clear()
        self.batch = BatchKVCache(self.model.config, self.device)


def _out(x: torch.Tensor) -> torch.Tensor:
    """float32 rows on the CPU, contiguous: the small-batch kernels return logits transposed, and
    every row-wise op after this (verification, the trace's top-K) runs 3-5x faster on rows."""
    x = x.float().cpu()
    return x if x.is_contiguous() else torch.stack(tuple(x))
