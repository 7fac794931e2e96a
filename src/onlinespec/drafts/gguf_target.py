"""The target of the bulk warm-up (:mod:`onlinespec.drafts.bulk`), from its GGUF file alone: no
tokenizer, no hub. The tensors are dequantized to fp32 under Hugging Face names and loaded into a
transformers Llama built from the config the bundle carries."""

from __future__ import annotations

from pathlib import Path

import torch

_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of the query / key rows for its rotary layout."""
    dim = weight.shape[0] // heads // 2
    return weight.reshape(heads, dim, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def llama_state_dict_from_gguf(path: str | Path, config: dict) -> dict[str, torch.Tensor]:
    """A Llama GGUF file's tensors, dequantized to fp32, under Hugging Face names (the same
    tensors transformers' own GGUF loader gives; a test checks it)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    state = {}
    for tensor in GGUFReader(str(path)).tensors:
        shape = [int(s) for s in reversed(tensor.shape)]
        weight = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)).float().reshape(shape)
        parts = tensor.name.split(".")
        if tensor.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif tensor.name == "output_norm.weight":
            name = "model.norm.weight"
        elif tensor.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_NAMES:
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.weight"
            if parts[2] == "attn_q":
                weight = _unpermute(weight, config["num_attention_heads"])
            elif parts[2] == "attn_k":
                weight = _unpermute(weight, config["num_key_value_heads"])
        else:
            raise ValueError(f"{path}: unexpected tensor {tensor.name!r} for a Llama model")
        state[name] = weight
    return state


def build_target(config: dict, state: dict[str, torch.Tensor] | None, device: str):
    """A Llama causal LM from a config dict and (optionally) its weights, fp32, on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("architectures", "transformers_version", "dtype", "torch_dtype")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**settings), dtype=torch.float32)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and config.get("tie_word_embeddings"))]
        if missing or unexpected:
            raise ValueError(f"the GGUF weights do not fit the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.tie_weights()
    return model.to(device).eval().requires_grad_(False)
