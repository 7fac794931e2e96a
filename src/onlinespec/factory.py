"""The Python entry point: build a speculative decoder from model specs.

>>> from onlinespec import load_decoder, SamplingParams
>>> decoder = load_decoder(target="default", draft="hybrid", k=4)
>>> out = decoder.generate([{"role": "user", "content": "Name three primes."}],
...                        SamplingParams(max_new_tokens=64))
>>> print(out.text, out.stats.acceptance_rate, out.stats.tokens_per_s)

Draft specs:

- ``"hybrid"``: n-gram lookup where the text offers a match, then the suffix index of earlier
  requests (empty until a server adds what it serves), else the packaged feature head trained
  for the default target (``"hybrid:FOLDER"`` for another head). For any other target, and
  with ``"hybrid:fresh"``, a fresh head born from the target's own embeddings and output layer
  (untrained: it learns from the traffic a server sees);
- ``"suffix"``: n-gram lookup, then the suffix index alone (model-free);
- ``"head"`` / ``"head:FOLDER"``: a feature-conditioned head alone (:mod:`onlinespec.drafts`);
- ``"ngram"`` / ``"ngram:N"``: prompt lookup, longest n-gram N (default 3);
- ``"target-layers:N"``: the target's first N layers; a Hugging Face folder or a ``.gguf`` file;
- ``"none"``: the target alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from onlinespec.decoding import kernels as small_batch
from onlinespec.decoding.adaptive import AdaptiveK
from onlinespec.decoding.calibrate import CONTEXTS, CostCurve, batch_sizes, measure_cost_curve
from onlinespec.decoding.feature_head import FeatureHead, is_feature_head
from onlinespec.decoding.proposal import DEFAULT_K
from onlinespec.decoding.proposers.base import Proposer
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.proposers.feature import FeatureHeadProposer
from onlinespec.decoding.proposers.hybrid import HybridProposer
from onlinespec.decoding.proposers.ngram import NgramProposer
from onlinespec.decoding.proposers.suffix import SuffixIndex, SuffixProposer
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.drafts.heads import DEFAULT_HEAD, load_head
from onlinespec.models import LoadedModel, cache_dir, check_same_tokenizer, load_draft, load_target, tokenizer_fingerprint
from onlinespec.storage import atomic_write
from onlinespec.tokens import eos_token_ids

log = logging.getLogger("onlinespec")

FRESH = "fresh"  # "hybrid:fresh", "head:fresh": a head born from the target, not the packaged one

# Chosen by measured end-to-end speed on 60 held-out prompts (docs/default-bench.md): 1.63x the
# target alone in fp32 with greedy output identical on 60/60 (bf16 was faster in absolute terms
# but its greedy output drifts from the target alone's at bf16 rounding ties).
DEFAULT_DRAFT = "hybrid"
DEFAULT_DTYPE = "auto"  # float32 on a CPU, bfloat16 on CUDA (onlinespec.backends.resolve_dtype_name)


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
        if not folder and not packaged_head_fits(target):  # another model: a head born from it learns from traffic
            log.info("the packaged head was trained for another target: %s starts with a fresh head (%s:fresh)", spec, kind)
            folder = FRESH
        if folder == FRESH:
            head = fresh_head(target)
        elif folder and (Path(folder) / "CURRENT").exists():
            head = published_head(Path(folder), target)
        else:
            head = load_head(folder or DEFAULT_HEAD, target)
        proposer = FeatureHeadProposer(head, name=f"head:{folder or 'default'}")
        return DraftChoice(HybridProposer(proposer, suffix_index=SuffixIndex()) if kind == "hybrid" else proposer)
    if is_feature_head(spec):
        return DraftChoice(FeatureHeadProposer(load_head(spec, target), name=spec))
    if spec.endswith(".gguf"):
        return DraftChoice(llamacpp_draft(spec, target))
    draft = load_draft(spec, target, dtype)
    return DraftChoice(DraftModelProposer(draft.model, name=spec), draft)


def llamacpp_draft(path: str, target: LoadedModel):
    """A GGUF draft model run by llama.cpp beside a target served on llama.cpp, sharing its tokenizer."""
    from onlinespec.decoding.proposers.llamacpp_draft import LlamaCppDraftProposer
    from onlinespec.ggufview import load_gguf_view

    if target.backend != "llama.cpp":
        raise ValueError(f"draft {path!r} is a GGUF file: it drafts beside a target served on llama.cpp (a GGUF target), "
                         f"not on {target.backend}")
    file = Path(path).expanduser()
    check_same_tokenizer(target.tokenizer, load_gguf_view(file)[1], target.name, path)
    return LlamaCppDraftProposer(file)


def published_head(directory: Path, target: LoadedModel) -> FeatureHead:
    """The version a server serves from its draft directory (``<out-dir>/drafts/<name>``, its
    ``CURRENT``), loaded into the head such a server starts from: the packaged head where it fits
    the target, else a fresh one (a draft learned from another start is a clear ValueError)."""
    from onlinespec.online.registry import DraftRegistry
    from onlinespec.weights import load_weights

    registry = DraftRegistry(directory)
    head = load_head(DEFAULT_HEAD, target) if packaged_head_fits(target) else fresh_head(target)
    load_weights(head, registry.load(), f"{directory}'s version {registry.current()}")
    return head


def packaged_head_fits(target: LoadedModel) -> bool:
    """Whether the packaged head was trained for ``target`` (its tokenizer and hidden size)."""
    info = FeatureHead.info(DEFAULT_HEAD) if is_feature_head(DEFAULT_HEAD) else {}
    return (info.get("tokenizer") == tokenizer_fingerprint(target.tokenizer)
            and info.get("config", {}).get("hidden_size") == target.model.config.hidden_size)


def fresh_head(target: LoadedModel) -> FeatureHead:
    """A head nobody trained (:meth:`FeatureHead.fresh`): it learns from the first requests."""
    return FeatureHead.fresh(target.model, eos_token_ids(target.model, target.tokenizer)).eval()


def load_decoder(
    target: str | LoadedModel = "default",
    draft: str = DEFAULT_DRAFT,
    k: int = DEFAULT_K,
    dtype: str = DEFAULT_DTYPE,
    calibrate: bool = True,
    adaptive_k: bool = True,
    max_batch: int = 1,
    backend: str = "auto",
    device: str = "auto",
) -> SpeculativeDecoder:
    """Load the target (a spec or an already loaded model) and a draft, and pair them.
    ``backend`` and ``device``: what runs the target (:mod:`onlinespec.backends`; ``auto``:
    llama.cpp for a GGUF file on a CPU, the packaged default included).

    ``calibrate`` times the target's forward per batch size (up to ``max_batch``), block width and
    context length (a few seconds per batch size) and pads verification blocks to the widths this
    machine runs fastest (:mod:`onlinespec.decoding.calibrate`); ``adaptive_k`` then also sends,
    per step, only as many proposals as pay on that cost curve at the step's batch size
    (:mod:`onlinespec.decoding.adaptive`; needs ``calibrate``).
    """
    loaded = target if isinstance(target, LoadedModel) else load_target(target, dtype, backend, device)
    choice = make_proposer(draft, loaded, dtype)
    options = engine_options(loaded, k, pad=calibrate, adaptive=adaptive_k and calibrate, max_batch=max_batch) if choice.proposer is not None else {}
    return new_decoder(loaded, choice.proposer, k, options, max_batch)


def new_decoder(target: LoadedModel, proposer: Proposer | None, k: int = DEFAULT_K, options: dict | None = None,
                max_batch: int = 1, **kwargs) -> SpeculativeDecoder:
    """A decoder over a fresh runner of ``target`` (its backend's), with :func:`engine_options`'s
    ``options`` (none: no cost curve, fixed k)."""
    options = options or {}
    runner = target.runner(max_batch, options.get("cost_curve"), options.get("pad", False))
    return SpeculativeDecoder(runner, target.tokenizer, proposer, k=k, max_batch=max_batch, adaptive_k=options.get("adaptive_k"),
                              eos_token_ids=eos_token_ids(target.model, target.tokenizer), **kwargs)


def engine_options(target: LoadedModel, k: int, pad: bool = True, adaptive: bool = False, kernels: bool = True,
                   max_batch: int = 1) -> dict:
    """``cost_curve``, ``pad`` and ``adaptive_k`` for :class:`SpeculativeDecoder`, from one
    measurement of the target's forward cost per batch size, block width and context length.

    ``kernels``: first switch the target to the small-batch linear kernels if they measure faster
    (:mod:`onlinespec.decoding.kernels`). They are set on the model itself, so a target-alone
    decoder sharing it runs them too, and comparisons stay fair.
    """
    width = max(8, k + 4)
    if not (pad or adaptive):
        if kernels and target.backend != "llama.cpp":  # llama.cpp's forwards run none of torch's linear layers
            small_batch.use_small_batch_kernels(target.model, max_width=width)
        return {"pad": False}
    curve = calibrate(target, kernels, width, k + 2, batch_sizes(max_batch))
    return {"cost_curve": curve, "pad": pad, "adaptive_k": AdaptiveK(curve, padded=pad) if adaptive else None}


RECALIBRATE = "ONLINESPEC_RECALIBRATE"  # set to 1: measure again (and replace the cached measurement)
# timed forwards per point (default 3, and 5 for the kernel choice; the test suite takes 1: its curves decide no claim)
CALIBRATION_REPS = "ONLINESPEC_CALIBRATION_REPS"


def calibrate(target: LoadedModel, kernels: bool, kernel_width: int, max_width: int, batches: tuple[int, ...]) -> CostCurve:
    """Choose the small-batch kernels (``kernels``) and measure the cost curve, once per machine.

    Both are timings of the target's forward (:mod:`onlinespec.decoding.calibrate`), 25-45 s of a
    server's start-up on a 2-core CPU. What they depend on is the architecture, dtype and device
    of the target, the torch build and threads, and the CPU, not its weights; so they are kept in
    ``$ONLINESPEC_CACHE/calibration/<key>.json`` under a key of exactly those, and a later start
    on the same machine reads them back. The curve is measured twice and kept only if both agree
    (:func:`steady_curve`): one measured while the machine was busy would steer adaptive k wrong
    on every later start. ``ONLINESPEC_RECALIBRATE=1`` measures again (after a change the key does
    not see: another load on the machine, a BIOS setting)."""
    model = target.model
    parameter = next(model.parameters())
    architecture = {k: v for k, v in model.config.to_diff_dict().items() if k not in ("_name_or_path", "transformers_version")}
    key = {"version": 2, "architecture": architecture, "dtype": str(parameter.dtype), "device": str(parameter.device),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "cpu": _cpu_name(),
           "kernels": "choose" if kernels else small_batch.enabled(model), "kernel_width": kernel_width, "max_width": max_width,
           "batches": list(batches), "contexts": list(CONTEXTS)}
    quick = int(os.environ.get(CALIBRATION_REPS) or 0)  # 0: the defaults
    reps = quick or 3
    if reps != 3:  # a quicker, noisier curve is kept apart from the full one
        key["reps"] = reps
    llama = target.backend == "llama.cpp"
    if llama:  # the GGUF file's weights and llama.cpp's kernels decide the curve; torch's kernels do not run
        import llama_cpp

        from onlinespec.decoding.runners.llamacpp import FLASH_ATTENTION, cpu_threads

        kernels = False
        key.update(backend="llama.cpp", gguf=[target.gguf.name, target.gguf.stat().st_size], llama_cpp=llama_cpp.__version__,
                   threads=cpu_threads(), dtype="gguf", kernels=False, flash_attention=FLASH_ATTENTION)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = cache_dir() / "calibration" / f"{digest}.json"
    if os.environ.get(RECALIBRATE) != "1" and (saved := _cached_calibration(path, key)) is not None:
        if kernels:
            (small_batch.enable if saved["kernels"] else small_batch.disable)(model)
        return saved["curve"]
    chosen = small_batch.use_small_batch_kernels(model, max_width=kernel_width, reps=quick or 5)[0] if kernels else small_batch.enabled(model)
    measure = lambda: measure_cost_curve(target.runner(max(batches)) if llama else model, max_width=max_width, batches=batches, reps=reps)
    curve, steady = steady_curve(measure) if "reps" not in key else (measure(), True)  # a quick curve is noisy anyway
    if not steady:  # a curve measured while something else ran would steer adaptive k wrong for good: not kept
        log.warning("the cost curve moved by more than %.0f%% between two measurements (is something else running?): "
                    "serving with the lower of the two, not caching it; the next start measures again", 100 * CURVE_TOLERANCE)
        return curve
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"key": key, "kernels": chosen, "curve": curve.to_dict(),
                                       "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, indent=1, default=str))
    except OSError as err:  # a read-only cache costs the next start a measurement, nothing else
        log.warning("the calibration could not be cached at %s: %s", path, err)
    return curve


def _cached_calibration(path: Path, key: dict) -> dict | None:
    """The calibration cached under ``key`` (at ``path``), or else one measured on more batch sizes
    and wider blocks, everything else equal (a server's curve answers a batch-1 bench); None: measure."""
    if not path.parent.is_dir():
        return None
    others = sorted(set(path.parent.glob("*.json")) - {path})
    for candidate in ([path] if path.exists() else []) + others:
        try:
            saved = json.loads(candidate.read_text())
            if candidate != path and not _covers(saved["key"], key):
                continue
            saved["curve"] = CostCurve.from_dict(saved["curve"])
        except (OSError, ValueError, KeyError, TypeError) as err:  # unreadable: measure again (and replace it)
            log.warning("the cached calibration %s could not be read (%s): measuring again", candidate, err)
            continue
        log.info("calibration read from %s (measured %s; %s=1 measures again)", candidate, saved["measured_at"], RECALIBRATE)
        return saved
    return None


def _covers(saved: dict, key: dict) -> bool:
    """A calibration under ``saved`` holds every point one under ``key`` would measure."""
    same = saved.keys() == key.keys() and all(saved[f] == v for f, v in key.items() if f not in ("batches", "max_width"))
    return same and set(key["batches"]) <= set(saved["batches"]) and saved["max_width"] >= key["max_width"]


CURVE_TOLERANCE = 0.5  # two measurements of the cost curve that differ by more than this at any point: the machine was busy


def steady_curve(measure) -> tuple[CostCurve, bool]:
    """Measure the curve twice; return the point-wise lower of the two (other work only ever adds
    time), and whether they agree within :data:`CURVE_TOLERANCE` at every point."""
    first, second = measure(), measure()
    lower, steady = {}, True
    for key, costs in first.seconds.items():
        other = second.seconds[key]
        lower[key] = [min(a, b) for a, b in zip(costs, other)]
        steady = steady and all(max(a, b) <= (1 + CURVE_TOLERANCE) * min(a, b) for a, b in zip(costs, other))
    return CostCurve(lower), steady


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
