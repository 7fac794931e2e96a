"""Does torch work on another thread, in turns (never at the same time), slow llama.cpp's decodes?

One llama.cpp runner of the default target decodes one token at a time (after a 100-token
prompt) on the main thread; beside it a "learner" thread takes turns with it under one lock, as
the engine's turns do (``onlinespec.online.turns``): 50 ms of torch training ops (a 256 x 576 by
576 x 1,536 matmul, its ReLU and backward) on ``T`` torch threads, then 200 ms of rest. The two
never compute at once. Each setting runs in a fresh process (OpenMP's state is per process),
alternating, ``--rounds`` times::

    python bench/learner_threads.py --rounds 2 --json docs/results/learner-threads.json

Settings: ``alone`` (no learner), ``turns T=1``, ``turns T=2``. Why it matters:
:mod:`onlinespec.online.budget`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

DECODES = 400


def child(learner_threads: int) -> dict:
    import torch

    from onlinespec.models import load_target

    runner = load_target("default").runner(max_rows=1)
    torch.set_num_threads(1)  # the engine thread's own torch work, as served
    request, lock, stop = object(), threading.Lock(), threading.Event()
    runner.forward_alone(request, list(range(100, 200)), 1)

    def learner() -> None:
        torch.set_num_threads(learner_threads)
        a, w = torch.randn(256, 576), torch.randn(576, 1536, requires_grad=True)
        while not stop.is_set():
            with lock:  # a turn: the decoder waits
                start = time.perf_counter()
                while time.perf_counter() - start < 0.05:
                    (a @ w).relu().sum().backward()
            time.sleep(0.2)

    if learner_threads:
        threading.Thread(target=learner, daemon=True).start()
    times = []
    for i in range(DECODES):
        with lock:
            start = time.perf_counter()
            runner.forward_alone(request, [5 + i % 50], 1)
            times.append((time.perf_counter() - start) * 1000)
        time.sleep(0.0005)
    stop.set()
    times.sort()
    return {"median_ms": statistics.median(times), "mean_ms": statistics.mean(times), "p90_ms": times[int(0.9 * len(times))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    settings = {"alone": 0, "turns T=1": 1, "turns T=2": 2}
    results: dict[str, list[dict]] = {name: [] for name in settings}
    for r in range(args.rounds):
        for name, threads in settings.items():
            out = subprocess.run([sys.executable, __file__, "--child", str(threads)], capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONWARNINGS": "ignore"})
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: {results[name][-1]}", flush=True)
    print("| setting | decode ms, median (per round) | p90 (per round) |\n|---|---|---|")
    for name, rows in results.items():
        medians, p90s = (" / ".join(f"{x[key]:.1f}" for x in rows) for key in ("median_ms", "p90_ms"))
        print(f"| {name} | {medians} | {p90s} |")
    if args.json:
        harness.write_result(args.json, {"decodes": DECODES, "results": results})


if __name__ == "__main__":
    main()
