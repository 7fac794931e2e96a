"""The Python entry point: build a speculative decoder from model specs.

>>> from onlinespec import load_decoder, SamplingParams
>>> decoder = load_decoder(target="default", draft="ngram", k=4)
>>> out = decoder.generate([{"role": "user", "content": "Name three primes."}],
...                        SamplingParams(max_new_tokens=64))
>>> print(out.text, out.stats.acceptance_rate, out.stats.tokens_per_s)

Draft specs: ``"ngram"`` / ``"ngram:N"`` (prompt lookup, longest n-gram N, default 3),
``"target-layers:N"`` (the target's first N layers), a Hugging Face folder or a ``.gguf`` file,
or ``"none"`` (the target alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from onlinespec.decoding.calibrate import forward_costs, padding_plan
from onlinespec.decoding.proposers.base import Proposer
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.proposers.ngram import NgramProposer
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.models import LoadedModel, load_draft, load_model

DEFAULT_DRAFT = "ngram"
DEFAULT_K = 4  # n-gram k=4 measured best (docs/engine-bench.md): a 5-token block runs on the fast kernel


@dataclass
class DraftChoice:
    """A proposer, and the draft model behind it when there is one (HF assisted generation needs it)."""

    proposer: Proposer | None
    model: LoadedModel | None = None


def make_proposer(spec: str, target: LoadedModel, dtype: str | torch.dtype = "float32") -> DraftChoice:
    if spec == "none":
        return DraftChoice(None)
    if spec == "ngram" or spec.startswith("ngram:"):
        max_ngram = int(spec.split(":", 1)[1]) if ":" in spec else 3
        return DraftChoice(NgramProposer(max_ngram=max_ngram))
    draft = load_draft(spec, target, dtype)
    return DraftChoice(DraftModelProposer(draft.model, name=spec), draft)


def load_decoder(
    target: str | LoadedModel = "default",
    draft: str = DEFAULT_DRAFT,
    k: int = DEFAULT_K,
    dtype: str | torch.dtype = "float32",
    calibrate: bool = True,
) -> SpeculativeDecoder:
    """Load the target (a spec or an already loaded model) and a draft, and pair them.

    ``calibrate`` times the target's forward per block width (about 3 s) and pads verification
    blocks to the widths this machine runs fastest (:mod:`onlinespec.decoding.calibrate`).
    """
    loaded = target if isinstance(target, LoadedModel) else load_model(target, dtype)
    choice = make_proposer(draft, loaded, dtype)
    padding = verify_padding(loaded, k) if calibrate and choice.proposer is not None else None
    return SpeculativeDecoder(loaded.model, loaded.tokenizer, choice.proposer, k=k, verify_padding=padding)


def verify_padding(target: LoadedModel, k: int) -> dict[int, int]:
    """The padding plan for verification blocks of up to k + 1 tokens, measured on this machine."""
    return padding_plan(forward_costs(target.model, max_width=max(8, k + 4)))
