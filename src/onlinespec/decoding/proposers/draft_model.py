"""A small draft language model with its own KV cache (the paper's setting)."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, PreTrainedModel

from onlinespec.decoding.proposers.base import Proposal
from onlinespec.decoding.sampling import SamplingParams, logits_to_probs, sample
from onlinespec.decoding.kvcache import truncate_cache


class DraftModelProposer:
    """Runs the draft autoregressively for ``k`` steps, reusing its KV cache across rounds."""

    def __init__(self, model: PreTrainedModel, name: str = "draft", version: str = "v0") -> None:
        self.model = model
        self.name = name
        self.version = version
        self._incoming: tuple[PreTrainedModel, str] | None = None
        self._cache: DynamicCache | None = None
        self._seen: list[int] = []  # the token ids whose keys/values are in the cache

    def begin(self, prompt_ids: list[int]) -> None:
        self._take_incoming()
        self._cache = DynamicCache(config=self.model.config)
        self._seen = []

    def swap_model(self, model: PreTrainedModel, version: str) -> None:
        """Hand over a new draft; safe to call from another thread. The engine's next round
        picks it up (a single reference assignment, so a round sees one draft or the other)."""
        self._incoming = (model, version)

    def _take_incoming(self) -> None:
        incoming, self._incoming = self._incoming, None
        if incoming is not None:
            self.model, self.version = incoming
            self._cache, self._seen = DynamicCache(config=self.model.config), []

    @torch.inference_mode()
    def propose(
        self,
        ids: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        with_probs: bool = False,
    ) -> Proposal:
        self._take_incoming()
        if self._cache is None:
            self.begin(ids)
        pending = self._sync(ids)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        keep_probs = with_probs or not params.greedy
        forward = 0.0
        for step in range(k):
            start = time.perf_counter()
            logits = self.model(
                input_ids=torch.tensor([pending]), cache=self._cache, logits_to_keep=1
            ).logits[0, -1]
            forward += time.perf_counter() - start
            self._seen.extend(pending)
            if params.greedy:
                token = int(logits.argmax())
                if keep_probs:
                    rows.append(logits.float().softmax(-1))
            else:
                probs = logits_to_probs(logits, params)
                token = sample(probs, generator)
                rows.append(probs)
            tokens.append(token)
            pending = [token]
        return Proposal(tokens, torch.stack(rows) if rows else None, forward)

    def _sync(self, ids: list[int]) -> list[int]:
        """Drop cached positions the engine discarded; return the ids the cache has not seen."""
        seen = self._seen
        if ids[: len(seen)] != seen:
            shorter = min(len(ids), len(seen))
            common = next((i for i in range(shorter) if ids[i] != seen[i]), shorter)
            truncate_cache(self._cache, common)
            del seen[common:]
        pending = ids[len(seen):]
        if not pending:  # everything is cached: re-feed the last token to get its logits
            truncate_cache(self._cache, len(seen) - 1)
            pending = [seen.pop()]
        return pending
