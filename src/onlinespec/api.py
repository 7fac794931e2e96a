"""The Python entry point: build a speculative decoder from model specs.

>>> from onlinespec import load_decoder, SamplingParams
>>> decoder = load_decoder(target="default", draft="hybrid", k=4)
>>> out = decoder.generate([{"role": "user", "content": "Name three primes."}],
...                        SamplingParams(max_new_tokens=64))
>>> print(out.text, out.stats.acceptance_rate, out.stats.tokens_per_s)

Draft specs:

- ``"hybrid"``: n-gram lookup where the text offers a match, then the suffix index of earlier
  requests (empty until a server adds what it serves), else the packaged feature head trained
  for the default target (``"hybrid:FOLDER"`` for another head);
- ``"suffix"``: n-gram lookup, then the suffix index alone (model-free);
- ``"head"`` / ``"head:FOLDER"``: a feature-conditioned head alone (:mod:`onlinespec.drafts`);
- ``"ngram"`` / ``"ngram:N"``: prompt lookup, longest n-gram N (default 3);
- ``"target-layers:N"``: the target's first N layers; a Hugging Face folder or a ``.gguf`` file;
- ``"none"``: the target alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from onlinespec.decoding.adaptive import AdaptiveK
from onlinespec.decoding.calibrate import batch_sizes, measure_cost_curve
from onlinespec.decoding.kernels import use_small_batch_kernels
from onlinespec.decoding.proposers.base import Proposer
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.proposers.feature import FeatureHeadProposer
from onlinespec.decoding.proposers.hybrid import HybridProposer
from onlinespec.decoding.proposers.ngram import NgramProposer
from onlinespec.decoding.proposers.suffix import SuffixIndex, SuffixProposer
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.drafts.feature_head import FeatureHead, is_feature_head
from onlinespec.models import LoadedModel, check_same_tokenizer_hash, load_draft, load_model

DEFAULT_HEAD = Path(__file__).parent / "assets" / "default-head"

# Chosen by measured end-to-end speed on 60 held-out prompts (docs/default-bench.md): 1.63x the
# target alone in fp32 with greedy output identical on 60/60 (bf16 was faster in absolute terms
# but its greedy output drifts from the target alone's at bf16 rounding ties).
DEFAULT_DRAFT = "hybrid"
DEFAULT_DTYPE = "float32"
DEFAULT_K = 4  # the most proposals per round; adaptive k verifies fewer when they would not pay


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
    if spec == "suffix":
        return DraftChoice(SuffixProposer(SuffixIndex()))
    if spec in ("head", "hybrid") or spec.startswith(("head:", "hybrid:")):
        kind, _, folder = spec.partition(":")
        head = load_head(folder or DEFAULT_HEAD, target)
        proposer = FeatureHeadProposer(head, name=f"head:{folder or 'default'}")
        return DraftChoice(HybridProposer(proposer, suffix_index=SuffixIndex()) if kind == "hybrid" else proposer)
    if is_feature_head(spec):
        return DraftChoice(FeatureHeadProposer(load_head(spec, target), name=spec))
    draft = load_draft(spec, target, dtype)
    return DraftChoice(DraftModelProposer(draft.model, name=spec), draft)


def load_head(folder: str | Path, target: LoadedModel) -> FeatureHead:
    """A saved feature head, checked against the target it is asked to draft for."""
    folder = Path(folder)
    if not is_feature_head(folder):
        hint = " (build it with `onlinespec warmup`)" if folder == DEFAULT_HEAD else ""
        raise FileNotFoundError(f"no feature head in {folder}{hint}")
    info = FeatureHead.info(folder)
    check_same_tokenizer_hash(info.get("tokenizer"), target.tokenizer, str(folder))
    return FeatureHead.load(folder, target.model)


def load_decoder(
    target: str | LoadedModel = "default",
    draft: str = DEFAULT_DRAFT,
    k: int = DEFAULT_K,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    calibrate: bool = True,
    adaptive_k: bool = True,
    max_batch: int = 1,
) -> SpeculativeDecoder:
    """Load the target (a spec or an already loaded model) and a draft, and pair them.

    ``calibrate`` times the target's forward per batch size (up to ``max_batch``), block width and
    context length (a few seconds per batch size) and pads verification blocks to the widths this
    machine runs fastest (:mod:`onlinespec.decoding.calibrate`); ``adaptive_k`` then also sends,
    per step, only as many proposals as pay on that cost curve at the step's batch size
    (:mod:`onlinespec.decoding.adaptive`; needs ``calibrate``).
    """
    loaded = target if isinstance(target, LoadedModel) else load_model(target, dtype)
    choice = make_proposer(draft, loaded, dtype)
    options = engine_options(loaded, k, pad=calibrate, adaptive=adaptive_k and calibrate, max_batch=max_batch) if choice.proposer is not None else {}
    return SpeculativeDecoder(loaded.model, loaded.tokenizer, choice.proposer, k=k, max_batch=max_batch, **options)


def engine_options(target: LoadedModel, k: int, pad: bool = True, adaptive: bool = False, kernels: bool = True,
                   max_batch: int = 1) -> dict:
    """``cost_curve``, ``pad`` and ``adaptive_k`` for :class:`SpeculativeDecoder`, from one
    measurement of the target's forward cost per batch size, block width and context length.

    ``kernels``: first switch the target to the small-batch linear kernels if they measure faster
    (:mod:`onlinespec.decoding.kernels`). They are set on the model itself, so a target-alone
    decoder sharing it runs them too, and comparisons stay fair.
    """
    width = max(8, k + 4)
    if kernels:
        use_small_batch_kernels(target.model, max_width=width)
    if not (pad or adaptive):
        return {"pad": False}
    curve = measure_cost_curve(target.model, max_width=k + 2, batches=batch_sizes(max_batch))
    return {"cost_curve": curve, "pad": pad, "adaptive_k": AdaptiveK(curve, padded=pad) if adaptive else None}
