"""What llama.cpp's flash attention does to the engine's forwards on this CPU.

One llama.cpp context with flash attention off and one with it on, on the same loaded GGUF; for
each cached context length (64, 512, 2,000 tokens) and block width w = 1..6 (every row's logits,
as the engine's verification asks), the median of ``--reps`` forwards, the two contexts
interleaved rep by rep (this machine's speed drifts). The engine's runner keeps llama.cpp's
default, on (``onlinespec.decoding.runners.llamacpp.FLASH_ATTENTION``): off is faster at long
contexts but makes a row's logits depend on its block's width (docs/engine.md, "Attention at
long contexts").

    python bench/attention_cost.py                          # the packaged target
    python bench/attention_cost.py --target FILE.gguf --out docs/results/attention_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

CONTEXTS = (64, 512, 2000)
WIDTHS = range(1, 7)
SETTINGS = ("disabled", "enabled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--target", default=None, help="a GGUF file (default: the packaged target)")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--out", default="bench/results/attention_cost.json")
    args = parser.parse_args()

    from onlinespec.benchmark import machine_info
    from onlinespec.decoding.runners import llamacpp
    from onlinespec.models import default_gguf_path

    path = Path(args.target) if args.target else default_gguf_path()
    model = llamacpp.LlamaCppModel.load(path)
    runners = {}
    for setting in SETTINGS:  # the runner reads the setting as it makes its context
        llamacpp.FLASH_ATTENTION = setting
        runners[setting] = llamacpp.LlamaCppRunner(model, max_rows=1, context=max(CONTEXTS) + 16)
    owners = {setting: object() for setting in SETTINGS}  # the request each runner holds
    ms: dict[str, dict[str, list[float]]] = {setting: {} for setting in SETTINGS}
    for context in CONTEXTS:
        for setting in SETTINGS:  # grow each runner's cached text to this context
            runner, owner = runners[setting], owners[setting]
            held = runner._length.get(id(owner), 0)
            runner.forward_alone(owner, [1000 + i % 500 for i in range(held, context)], 0)
        for setting in SETTINGS:
            ms[setting][str(context)] = []
        for width in WIDTHS:
            times: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
            for _ in range(args.reps):
                for setting in SETTINGS:
                    runner, owner = runners[setting], owners[setting]
                    tick = time.perf_counter()
                    runner.forward_alone(owner, list(range(7, 7 + width)), width)
                    times[setting].append(time.perf_counter() - tick)
                    runner.join(owner, context)  # drop the block again
            for setting in SETTINGS:
                ms[setting][str(context)].append(round(statistics.median(times[setting]) * 1000, 2))
        print(f"context {context:5d}  " + "  ".join(f"{s}: {' '.join(f'{v:6.1f}' for v in ms[s][str(context)])}" for s in SETTINGS), flush=True)
    result = {"command": "python bench/attention_cost.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
              "target": str(path), "machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "widths": list(WIDTHS), "ms": ms,
              "enabled_over_disabled": {c: [round(on / off, 3) for on, off in zip(ms["enabled"][c], ms["disabled"][c])] for c in ms["disabled"]}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["enabled_over_disabled"]))


if __name__ == "__main__":
    main()
