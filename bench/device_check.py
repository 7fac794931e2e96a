"""Time the torch backend on a CUDA GPU: the target alone and the verify cost curve, batched.

The packaged GGUF (98 MB) is more than a device call carries, so the target is built there from a
config with random weights (timing does not depend on the weights): SmolLM2-135M's shape, and a
1.1B Llama shape. For each: the verify cost curve (widths 1..8 at 1, 4, 8 and 32 requests in
flight, contexts 64 and 512) through the same runner the engine uses, and the target alone's
tokens/s through the engine at 1, 4, 8 and 32 in flight. Writes ``device-check.json``.

    bash bench/device_check.sh              # on the GPU machine (about 5 min on one H200)
    python bench/device_check.py --device cpu --quick   # the same code path on a CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from onlinespec.decoding.calibrate import measure_cost_curve
from onlinespec.decoding.runners.torch_runner import TorchRunner
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

SHAPES = {
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                         "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True},
    "llama-1.1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
                       "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False},
}


def build(shape: str, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval().requires_grad_(False)


def alone_tokens_per_s(model, in_flight: int, new_tokens: int, prompt_tokens: int) -> float:
    decoder = SpeculativeDecoder(TorchRunner(model), None, None, k=0, max_batch=in_flight, eos_token_ids=frozenset())
    generator = torch.Generator().manual_seed(in_flight)
    prompts = torch.randint(0, model.config.vocab_size, (2 * in_flight, prompt_tokens), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    decoder.generate_many(prompts[:in_flight], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    _sync()
    start = time.perf_counter()
    outs = decoder.generate_many(prompts, params)
    _sync()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=Path("runs/device"))
    parser.add_argument("--quick", action="store_true", help="the tiny shape only, short runs (checks the script)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    shapes = ["tiny"] if args.quick else ["smollm2-135m", "llama-1.1b"]
    batches = (1, 4) if args.quick else (1, 4, 8, 32)
    result = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor(),
              "torch": torch.__version__, "dtype": args.dtype, "shapes": {}}
    for shape in shapes:
        model = build(shape, args.device, dtype)
        tick = time.perf_counter()
        curve = measure_cost_curve(TorchRunner(model, pad=False), max_width=8, batches=batches, reps=5)
        entry = {"cost_curve_ms": curve.milliseconds(3),
                 "curve_seconds": round(time.perf_counter() - tick, 1), "alone_tokens_per_s": {}}
        for in_flight in batches:
            entry["alone_tokens_per_s"][in_flight] = round(alone_tokens_per_s(model, in_flight, 16 if args.quick else 64, 128), 1)
            print(shape, in_flight, "in flight:", entry["alone_tokens_per_s"][in_flight], "tokens/s", flush=True)
        print(shape, "verify cost curve (ms):", json.dumps(entry["cost_curve_ms"]), flush=True)
        result["shapes"][shape] = entry
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        harness.write_result(args.out / "device-check.json", result)


if __name__ == "__main__":
    main()
