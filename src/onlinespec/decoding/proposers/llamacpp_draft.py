"""A smaller model of the target's family, run by llama.cpp, drafting k tokens a round.

The classic draft model of speculative decoding (arXiv 2310.07177, section 2), for a target served
on llama.cpp: a GGUF file with the target's tokenizer (Qwen2.5-Coder-0.5B beside the 1.5B). Its
KV cache is kept per request in a llama.cpp context of its own, one sequence per request,
trimmed to the tokens the engine kept after each verification. Greedy requests get its argmax;
sampled ones draw from its distribution (after their temperature, top-k and top-p) with their own
generator and return the rows they drew from, as the exact verifier needs.

It does not learn (its weights are llama.cpp's); it is here to compare against the drafts that do
(docs/backends.md, "A 1.5B target"). A sequence is freed when its request's draft state is gone;
when more requests draft than it has sequences, the least recently used one loses its cache and
prefills again on its next round.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from pathlib import Path

import torch

from onlinespec.decoding.proposal import DraftInput, Proposal
from onlinespec.decoding.proposers.base import PerRequestProposer
from onlinespec.decoding.proposers.draft_model import draft_token, resync
from onlinespec.decoding.runners.llamacpp import LlamaCppModel, LlamaCppRunner

DRAFT_CONTEXT = 4096  # tokens per request in the draft's cache (a longer request drafts from its last ones)


class LlamaCppDraftState:
    """One request's place in the draft's cache: the key its sequence is held under, the tokens it holds."""

    def __init__(self) -> None:
        self.key = object()  # what the runner holds (never the state itself: a state that is gone frees its sequence)
        self.seen: list[int] = []


class LlamaCppDraftProposer(PerRequestProposer):
    drafter = "model"

    def __init__(self, path: str | Path, max_rows: int = 8, context: int = DRAFT_CONTEXT) -> None:
        self.path = Path(path)
        self.name = f"llama.cpp:{self.path.name}"
        self.model = LlamaCppModel.load(self.path)
        self.runner = LlamaCppRunner(self.model, max_rows=max_rows, context=context)
        self._held: OrderedDict[int, tuple[weakref.ref, object]] = OrderedDict()  # id(key) -> (its state, key), least recent first

    def start(self, prompt_ids: list[int]) -> LlamaCppDraftState:
        return LlamaCppDraftState()

    @torch.inference_mode()
    def propose_one(self, d: DraftInput) -> Proposal:
        state = d.state if d.state is not None else LlamaCppDraftState()
        ids = d.ids[-(self.runner.context - d.k - 1):]  # what fits the draft's context, the end of the text
        self._hold(state)
        pending = resync(state.seen, ids, lambda n: self.runner.truncate(state.key, n))
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        started = time.perf_counter()
        for _ in range(d.k):
            logits = self.runner.forward_alone(state.key, pending, 1)[0][-1]
            state.seen.extend(pending)
            tokens.append(draft_token(logits, d, rows))
            pending = [tokens[-1]]
        return Proposal(tokens, torch.stack(rows) if rows else None, time.perf_counter() - started, drafter=self.drafter)

    def _hold(self, state: LlamaCppDraftState) -> None:
        """A sequence for ``state``: free those of requests that are gone, then the least recently used one."""
        key = id(state.key)
        if key in self._held:
            self._held.move_to_end(key)
            return
        for gone in [k for k, (ref, _) in self._held.items() if ref() is None]:
            self.runner.release([self._held.pop(gone)[1]])
        if len(self._held) >= self.runner.sequences:
            _, (ref, evicted) = self._held.popitem(last=False)
            self.runner.release([evicted])
            if ref() is not None:
                ref().seen.clear()
        self._held[key] = (weakref.ref(state), state.key)
