"""Which library runs the target, on which device (``docs/backends.md``).

- ``llama.cpp``: the target's GGUF file as shipped (:mod:`onlinespec.decoding.runners.llamacpp`);
  the default for a GGUF target (the packaged default included) on a CPU.
- ``torch``: a Hugging Face model in PyTorch (:mod:`onlinespec.decoding.runners.torch_runner`),
  on the CPU or a CUDA device (bf16 there unless asked otherwise); the default for a folder.

Either way the Hugging Face model is loaded too: its tokenizer, config and generation config, and
the input and output embeddings a feature head borrows (the head drafts in PyTorch). With
llama.cpp the target's forwards never touch its decoder layers.
"""

from __future__ import annotations

import importlib.util

import torch

BACKENDS = ("auto", "torch", "llama.cpp")
DEVICES = ("auto", "cpu", "cuda")


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def resolve_device(device: str) -> str:
    """``auto``: a CUDA device when torch sees one, else the CPU."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (this torch build or this machine has none); use --device cpu")
    return device


def resolve_backend(backend: str, gguf: bool, device: str) -> str:
    """The backend for a target that is (``gguf``) or is not a GGUF file, on ``device`` (resolved)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "llama.cpp" if gguf and device == "cpu" and llama_cpp_installed() else "torch"
    if backend == "llama.cpp":
        if not gguf:
            raise ValueError("the llama.cpp backend runs GGUF files: give a .gguf target (or 'default'), or use --backend torch")
        if device != "cpu":
            raise ValueError("the llama.cpp backend runs on the CPU here: use --backend torch for --device cuda")
    return backend


def resolve_dtype_name(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on CUDA, float32 on the CPU (where bf16 drifts from fp32 at ties, docs/default-bench.md)."""
    if dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return dtype
