"""One draft step of the packaged feature head, alone in a loop: float32 against the served int8 copy.

A step as the proposer runs it at batch 1 (`FeatureHead.step`, `logits`, softmax, argmax), one
torch thread (the engine's), 300 steps a round, the variants interleaved round by round (this
machine's speed drifts): the float32 head, the served copy (`served_copy`: every matrix of at
least `SERVED_INT8_FROM` weights in int8), and the served copy as it was before 2026-12-07 (only
matrices of 2^20 weights or more in int8). Then the served copy's parts, one by one. The head's
weights stay in cache between steps here; in the engine the target's forward runs in between, so
`onlinespec bench`'s c (draft time per drafted token over one target step) is the figure to quote
for serving; this one says where a step's time goes.

    python bench/head_step.py                 # 3 rounds (~30 s)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from onlinespec.decoding import feature_head
from onlinespec.drafts.heads import load_head
from onlinespec.models import load_target

HEAD = Path(__file__).resolve().parents[1] / "src" / "onlinespec" / "assets" / "default-head"


def median_ms(fn, steps: int) -> float:
    for _ in range(20):  # warm-up
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 3)


def draft_step(head, feature, token):
    return lambda: head.logits(head.step(feature, token)).softmax(-1).argmax(-1).tolist()


def served_from(head, int8_from: int):
    """The served copy with matrices of at least ``int8_from`` weights in int8."""
    kept, feature_head.SERVED_INT8_FROM = feature_head.SERVED_INT8_FROM, int8_from
    try:
        return feature_head.served_copy(head)
    finally:
        feature_head.SERVED_INT8_FROM = kept


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    head = load_head(HEAD, load_target("default")).eval()
    variants = {"float32": head, "served (int8)": feature_head.served_copy(head), "int8 from 2^20 (before)": served_from(head, 1 << 20)}
    feature, token = torch.randn(1, head.config.hidden_size), torch.tensor([100])
    for r in range(args.rounds):
        print(f"round {r + 1}: " + ", ".join(f"{name} {median_ms(draft_step(h, feature, token), args.steps)} ms"
                                            for name, h in variants.items()), flush=True)
    s = variants["served (int8)"]
    x = torch.cat([s.in_norm_feature(feature), s.in_norm_token(s.embedding[token].float())], -1)
    y = s.fuse(x)
    logits = s.logits(y)
    parts = {"token embedding and norms": lambda: torch.cat([s.in_norm_feature(feature), s.in_norm_token(s.embedding[token].float())], -1),
             "fuse layer": lambda: s.fuse(x), "one block": lambda: s.blocks[0](y), "output norm": lambda: s.out_norm(y),
             f"output rows ({s.vocab_size})": lambda: s.logits(y), "softmax and argmax": lambda: logits.softmax(-1).argmax(-1).tolist()}
    for name, fn in parts.items():
        print(f"  {name}: {median_ms(fn, args.steps)} ms", flush=True)


if __name__ == "__main__":
    main()
