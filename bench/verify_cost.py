"""What one verification forward costs in the engine against a bare llama.cpp eval, per weight format.

For each GGUF (the shipped Q4_1 and its converted copies, onlinespec.formats), interleaved
width by width (this machine's speed drifts): the median milliseconds of

- `bare last row`: llama-cpp-python `Llama.eval` of w new tokens after a 100-token prompt,
  logits of the last row only (what plain decoding asks for);
- `bare all rows`: the same with every row's logits (`logits_all`: what verification needs);
- `engine`: onlinespec's runner forward as the engine calls it to verify (every row's logits and
  final hidden state, copied out to torch), rolled back after.

    python bench/verify_cost.py                      # as-is and q8_0, widths 1..8 (~2 min)
    python bench/verify_cost.py --formats as-is,q8_0,f16
    python bench/verify_cost.py --target ~/.cache/onlinespec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --formats as-is --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from onlinespec.decoding.runners.llamacpp import LlamaCppModel, LlamaCppRunner, cpu_threads
from onlinespec.formats import served_file
from onlinespec.models import default_gguf_path

PROMPT = 100


def bare(path: Path, logits_all: bool):
    import llama_cpp

    llama = llama_cpp.Llama(str(path), n_ctx=512, n_batch=512, n_threads=cpu_threads(), n_threads_batch=cpu_threads(),
                            logits_all=logits_all, verbose=False)
    llama.eval(list(range(1000, 1000 + PROMPT)))

    def run(width: int) -> float:
        llama.n_tokens = PROMPT
        start = time.perf_counter()
        llama.eval(list(range(2000, 2000 + width)))
        return time.perf_counter() - start

    return run


def engine(path: Path):
    runner = LlamaCppRunner(LlamaCppModel.load(path), max_rows=1, context=512)
    row = object()
    runner.forward_alone(row, list(range(1000, 1000 + PROMPT)), 1)
    runner.join(row, PROMPT)

    def run(width: int) -> float:
        start = time.perf_counter()
        runner.forward([list(range(2000, 2000 + width))])
        seconds = time.perf_counter() - start
        runner.rewind()
        return seconds

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=None, help="a GGUF file (default: the packaged target)")
    parser.add_argument("--formats", default="as-is,q8_0")
    parser.add_argument("--max-width", type=int, default=8)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "verify-cost.json")
    args = parser.parse_args()
    shipped = args.target.expanduser() if args.target else default_gguf_path()
    files = {fmt: served_file(shipped, fmt) for fmt in args.formats.split(",")}
    methods = {(fmt, name): make(path) for fmt, path in files.items()
               for name, make in (("bare last row", lambda p: bare(p, False)), ("bare all rows", lambda p: bare(p, True)), ("engine", engine))}
    times = {key: {w: [] for w in range(1, args.max_width + 1)} for key in methods}
    for rep in range(args.reps + 2):
        for width in range(1, args.max_width + 1):
            for key, run in methods.items():
                seconds = run(width)
                if rep >= 2:  # warm-up
                    times[key][width].append(seconds)
        print(f"rep {rep + 1}/{args.reps + 2}", flush=True)
    ms = {f"{fmt} | {name}": [round(1000 * statistics.median(times[(fmt, name)][w]), 2) for w in range(1, args.max_width + 1)]
          for fmt, name in methods}
    harness.write_result(args.out, {"threads": cpu_threads(), "prompt_tokens": PROMPT, "files": {k: str(v) for k, v in files.items()}, "ms": ms})
    print("| file and method | " + " | ".join(f"w={w}" for w in range(1, args.max_width + 1)) + " | t(5)/t(1) |")
    print("|---|" + "---|" * (args.max_width + 1))
    for key, row in ms.items():
        print(f"| {key} | " + " | ".join(f"{x:.1f}" for x in row) + f" | {row[4] / row[0]:.2f} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
