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
