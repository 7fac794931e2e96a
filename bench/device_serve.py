"""The real packaged target on a CUDA GPU (torch backend, bf16): lossless and speed, then the cold start.

``bench/device_check.py`` times random weights; this runs the packaged SmolLM2-135M (the GGUF
dequantised by transformers, then bf16 on the GPU) with the packaged head, as `onlinespec serve
--device cuda` would:

1. ``bench``: the target alone and speculative decoding with the default draft, both batched by
   the same engine, on the held-out prompts at 1, 8 and 32 requests in flight
   (:func:`onlinespec.benchmark.run_concurrency_bench`): tokens/s side by side, interleaved by
   level, and greedy output checked token for token against the target alone.
2. ``cold-start``: an online-split stream (chat, code, multilingual maths in turn, as `bench/cold_start.py`) through a serving core in
   this process (:func:`onlinespec.stream.run_stream`), 8 in flight, every request served by the
   learning drafts (packaged head, one per domain), the same draft kept static, and a draft born
   from the target with no packaged head (``fresh``), learning from every request; then the target
   alone. Acceptance by block of 40 requests for each; greedy output checked against the target alone.

The device machine has no data sets and no tokenizer download: ``export`` writes both query files
here (they travel with the call) and ``bench/device_serve.sh`` runs the rest there.

    python bench/device_serve.py export --out .gpu                     # here
    bash bench/device_serve.sh                                         # there (about 6 min on one H200)
    python bench/device_serve.py all --inputs .gpu --device cpu --quick # the same code on a CPU, small
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

COLD_DOMAINS = ["chat", "code", "math_ml"]  # as bench/cold_start.py: maths in 23 languages


def export(out: Path, n_heldout: int, n_stream: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from cold_start import online_split

    from onlinespec.data import write_queries_jsonl
    from onlinespec.data.sources import packaged_prompts

    out.mkdir(parents=True, exist_ok=True)
    write_queries_jsonl(out / "heldout.jsonl", packaged_prompts(n_heldout, split="heldout"))
    write_queries_jsonl(out / "stream.jsonl", online_split(n_stream, COLD_DOMAINS))
    print("wrote", out / "heldout.jsonl", out / "stream.jsonl")


def bench(inputs: Path, out: Path, device: str, quick: bool) -> dict:
    from onlinespec.benchmark import BenchConfig, run_concurrency_bench
    from onlinespec.data import read_queries_jsonl

    queries = read_queries_jsonl(inputs / "heldout.jsonl")[: 4 if quick else None]
    levels = (1, 4) if quick else (1, 8, 32)
    config = BenchConfig(device=device, backend="torch", max_new_tokens=8 if quick else 64)

    def on_level(level, method, figures):
        print(f"  bench: {level} in flight, {method}: {figures['tokens_per_s']:.1f} tokens/s", flush=True)

    result = run_concurrency_bench(queries, config, levels, on_level=on_level)
    harness.write_result(out / "device-bench.json", result)
    return result


def cold_start(inputs: Path, out: Path, device: str, quick: bool, n: int) -> dict:
    from onlinespec.data import read_queries_jsonl
    from onlinespec.online.learner import LearnerConfig
    from onlinespec.serve.config import CoreConfig
    from onlinespec.stream import OnlineConfig, run_stream

    queries = read_queries_jsonl(inputs / "stream.jsonl")[: 12 if quick else n]
    core = CoreConfig(backend="torch", device=device, max_batch=8, default_max_tokens=48,
                      learner=replace(LearnerConfig(), update_interval=3 if quick else 10))
    config = OnlineConfig(core=core, max_new_tokens=8 if quick else 48, concurrency=8, compare_every=1, fresh=True)
    rows: list[dict] = []

    def on_request(row: dict) -> None:
        rows.append(row)
        if len(rows) % 20 == 0:  # what a run cut short by the lease still brings back
            print(f"  cold start: {len(rows)} requests", flush=True)
            (out / "device-cold-start-partial.json").write_text(json.dumps({"blocks": alpha_blocks(rows, 40)}, indent=1))

    summary = run_stream(queries, config, out / "cold-run", on_request=on_request, on_status=lambda s: print("  cold start:", s, flush=True))
    result = {"summary": summary, "blocks": alpha_blocks(rows, 40)}
    harness.write_result(out / "device-cold-start.json", result)
    return result


def alpha_blocks(rows: list[dict], size: int) -> list[dict]:
    """Mean acceptance per block of ``size`` requests (in stream order) for each draft that served them."""
    rows = sorted(rows, key=lambda r: r["i"])
    blocks = []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        entry = {"requests": f"{start + 1}-{start + len(chunk)}"}
        for key in ("online", "static", "fresh"):
            values = [(r if key == "online" else r.get(key) or {}).get("acceptance_rate") for r in chunk]
            values = [v for v in values if v is not None]
            entry[key] = round(sum(values) / len(values), 4) if values else None
        blocks.append(entry)
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["export", "bench", "cold-start", "all"])
    parser.add_argument("--inputs", type=Path, default=Path(".gpu"))
    parser.add_argument("--out", type=Path, default=Path("runs/device"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=240, help="cold-start requests")
    parser.add_argument("--quick", action="store_true", help="a few short requests (checks the script)")
    args = parser.parse_args()
    if args.what == "export":
        export(args.inputs, 32, 600)
        return
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    info = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__}
    print(json.dumps(info), flush=True)
    harness.write_result(args.out / "device-info.json", info)
    parts = ["bench", "cold-start"] if args.what == "all" else [args.what]
    failed = False
    for part in parts:  # each part on its own: one failing leaves the other's figures
        tick = time.perf_counter()
        try:
            if part == "bench":
                bench(args.inputs, args.out, args.device, args.quick)
            else:
                cold_start(args.inputs, args.out, args.device, args.quick, args.n)
            print(f"{part}: done in {time.perf_counter() - tick:.0f} s", flush=True)
        except Exception:  # noqa: BLE001 (reported, and the next part still runs)
            failed = True
            traceback.print_exc()
            print(f"{part}: FAILED after {time.perf_counter() - tick:.0f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
