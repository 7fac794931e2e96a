"""What one batched forward of the engine's llama.cpp runner costs, by the batch's shape, with a KV
stream per sequence (``kv_unified`` off, the runner's setting) and with one unified KV cache.

Nine requests hold 100 cached tokens each; each forward is one ``llama_decode`` (the runner's
``_decode``) over ``n`` of them (every row's logits, as verification asks), dropped again after. Shapes:
``n`` rows of one token (a target alone's step at ``n`` in flight), eight rows whose ids leave
one out (a request prefilling, or a prefix-cache entry, among the running ones), rows of five
tokens (k = 4 verification), and mixed widths. The batch holds the rows in sequence-id order
(0, 1, 2, ...; the runner's ``forward`` sorts them so) or in reverse order (as the engine's rows
stood once requests had come and gone, before that sort). With a stream per sequence llama.cpp
splits a batch into micro-batches of consecutive sequence ids holding the same number of tokens
each, one graph per micro-batch. The three settings are interleaved shape by shape, ``--rounds``
times (this machine's speed drifts).

    python bench/batch_cost.py --out docs/results/batch_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

SHAPES = {"1 x 1": [1], "2 x 1": [1] * 2, "4 x 1": [1] * 4, "8 x 1": [1] * 8, "8 x 1, id 4 left out": [1] * 8,
          "1 x 5": [5], "4 x 5": [5] * 4, "5,1,1,1": [5, 1, 1, 1], "8 mixed (5,1)": [5, 1] * 4}
SETTINGS = {"streams, ids in order": (False, False), "streams, ids reversed": (False, True), "unified, ids reversed": (True, True)}
CACHED = 100


class _Request:
    """What the runner keys a sequence by: the object's identity."""


def measure(model, unified: bool, reverse: bool, reps: int) -> dict[str, float]:
    """Median milliseconds of one forward for each shape on a fresh runner."""
    from onlinespec.decoding.runners import llamacpp

    llamacpp.KV_UNIFIED = unified  # the runner reads it as it makes its context
    runner = llamacpp.LlamaCppRunner(model, max_rows=9, context=1024)
    requests = [_Request() for _ in range(9)]
    for i, request in enumerate(requests):
        runner.prefill(request, [1000 + (7 * i + j) % 500 for j in range(CACHED)])
        runner.join(request, CACHED)
    ids = [runner._seq[id(r)] for r in requests]
    ms = {}
    for name, widths in SHAPES.items():
        seqs = ids[:4] + ids[5:9] if "left out" in name else ids[:len(widths)]  # a sequence not in the step (prefilling, a cache entry)
        seqs = seqs[::-1] if reverse else seqs  # the batch's order
        entries = [(seq, CACHED, [7 + j for j in range(w)], w) for seq, w in zip(seqs, widths)]
        times = []
        for _ in range(reps):
            tick = time.perf_counter()
            runner._decode(entries)  # one llama_decode, every row's logits
            times.append(time.perf_counter() - tick)
            for seq in seqs:  # drop the block again
                runner._lib.llama_memory_seq_rm(runner._memory, seq, CACHED, -1)
        ms[name] = statistics.median(times) * 1000
    runner.release(requests)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--target", default=None, help="a GGUF file (default: the packaged target)")
    parser.add_argument("--reps", type=int, default=9, help="forwards per shape and setting in a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/batch_cost.json")
    args = parser.parse_args()

    from onlinespec.decoding.runners import llamacpp
    from onlinespec.models import default_gguf_path

    path = Path(args.target) if args.target else default_gguf_path()
    model = llamacpp.LlamaCppModel.load(path)
    rounds: dict[str, list[dict[str, float]]] = {setting: [] for setting in SETTINGS}
    for i in range(args.rounds):
        for setting in harness.rotated(list(SETTINGS), i):
            rounds[setting].append(measure(model, *SETTINGS[setting], args.reps))
            print(f"round {i + 1} {setting:24s} " + "  ".join(f"{s}: {v:6.1f}" for s, v in rounds[setting][-1].items()), flush=True)
    ms = {setting: {shape: round(statistics.median(r[shape] for r in runs), 2) for shape in SHAPES} for setting, runs in rounds.items()}
    over_one = {setting: {shape: round(v / row["1 x 1"], 2) for shape, v in row.items()} for setting, row in ms.items()}
    harness.write_result(args.out, {"target": str(path), "cached_tokens": CACHED, "shapes": SHAPES, "reps": args.reps,
                                    "rounds": args.rounds, "ms": ms, "over_one_token": over_one, "per_round": rounds})
    for setting, row in over_one.items():
        print(f"{setting:24s} " + "  ".join(f"{s}: {v:.2f}x" for s, v in row.items()))


if __name__ == "__main__":
    main()
