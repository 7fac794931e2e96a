"""Helpers for saving model weights with safetensors."""

from __future__ import annotations

import torch


def unique_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the names of tensors that share memory with an earlier one (tied embeddings), which
    safetensors refuses; load with ``strict=False`` and re-tie (``model.tie_weights()``)."""
    seen, out = set(), {}
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out[name] = tensor.detach().contiguous().cpu()
    return out


def load_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], label: str = "these weights") -> None:
    """Load ``state_dict`` into ``model`` strictly: every tensor the model has, except the tied
    names :func:`unique_tensors` dropped, must be there with its shape, and nothing else; then
    re-tie. Weights saved for another draft are a clear ``ValueError``, never a silent partial load."""
    tied = set(model.state_dict()) - set(unique_tensors(model.state_dict()))
    try:
        result = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as err:  # a size mismatch
        raise ValueError(f"{label} do not fit this draft (saved for another draft or target?): {err}") from None
    missing = [name for name in result.missing_keys if name not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"{label} do not fit this draft (saved for another draft or target?): missing {missing[:4]}, "
                         f"unexpected {result.unexpected_keys[:4]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
