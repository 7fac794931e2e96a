"""Why online updates on a familiar domain were refused, and what makes them pass and help.

A replay of the online learner on one domain, without serving: the target's greedy answers to
``--stream`` online-split requests (48 new tokens, cached), a learner that every ``I`` requests
trains a copy of the serving head on the answers so far (less the gate's hold-out), a gate that
publishes the copy only if its alpha on the hold-out is no worse, and the truth the gate tries to
guess: the hybrid's alpha (n-gram lookup + head, replayed exactly, ``replay_acceptance``) on
``--heldout`` requests of the held-out split that no update ever saw. One row per hypothesis::

    python bench/gate_experiments.py --domain stdlib --out docs/gate-experiments

Hypotheses (each row changes one thing from ``baseline``, the learner's settings in the issue:
I = 10, 40 steps of batch 32 at lr 3e-4 on every verified position, Adam state carried on, the
gate holding out the newest 20% of requests):
- ``lr 1e-4``: the step size overfits a few requests;
- ``1 epoch``: 40 x 32 examples are several passes over 10 requests' rows: cap steps at one
  epoch of the rows so far;
- ``head rows``: rows the n-gram lookup would have proposed teach the head what it never drafts;
- ``hold-out positions``: the newest requests are other functions, so the hold-out measures
  transfer to new code, not fit; hold out a random 20% of positions of every request instead;
- ``I = 25``: more data per update;
- and, after the first round, the learning rate and steps around the best of them.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from onlinespec.data.sources import stream_pools
from onlinespec.data.splits import split
from onlinespec.distill.loop import run_steps
from onlinespec.distill.signal import SignalConfig, build_signal
from onlinespec.distill.step import DistillConfig
from onlinespec.drafts.train import ChainConfig, ChainTask, replay_acceptance
from onlinespec.factory import DEFAULT_HEAD, load_head
from onlinespec.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_sim import ngram_covered  # noqa: E402  (the rounds the hybrid drafts by n-gram lookup)

NEW_TOKENS = 48


@dataclass(frozen=True)
class Setting:
    name: str
    interval: int = 10
    steps: int = 40
    batch: int = 32
    lr: float = 3e-4
    epoch_cap: bool = False
    head_rows: bool = False
    holdout: str = "requests"  # requests: the newest 20% of requests; positions: 20% of every request's positions


SETTINGS = [
    Setting("baseline"),
    Setting("lr 1e-4", lr=1e-4),
    Setting("1 epoch", epoch_cap=True),
    Setting("head rows", head_rows=True),
    Setting("hold-out positions", holdout="positions"),
    Setting("I = 25", interval=25),
    Setting("lr 1e-4 + 1 epoch + hold-out positions", lr=1e-4, epoch_cap=True, holdout="positions"),
    Setting("lr 5e-5", lr=5e-5),
    Setting("lr 1e-4 + 20 steps", lr=1e-4, steps=20),
    Setting("lr 1e-4 + I = 25", lr=1e-4, interval=25),
]


def alpha(scored) -> float:
    return sum(a for a, _ in scored) / max(1, sum(j for _, j in scored))


def gate_alpha(head, signal, starts: torch.Tensor) -> float:
    """Teacher-forced first-proposal agreement at ``starts`` (what the learner's gate measures)."""
    task = ChainTask(signal, ChainConfig(depth=1, generated_only=True))
    task.starts = starts
    with torch.inference_mode():
        _, logits, pos, valid = next(task.chain_outputs(head, starts, 1))
        hit = (head.vocab_ids[logits.argmax(-1)] == signal.top_ids[pos, 0]) & valid
    return float(hit.sum()) / max(1, int(valid.sum()))


def run(setting: Setting, start_head, stream, heldout) -> dict:
    head = start_head.clone()
    optimizer = None
    generator = torch.Generator().manual_seed(0)
    n = len(stream)
    published = refused = 0
    gate_log = []
    full = ChainTask(stream, ChainConfig(generated_only=True))
    seq_of = stream.sequence_of()[full.starts]
    in_holdout = torch.rand(len(full.starts), generator=torch.Generator().manual_seed(1)) < 0.2
    covered = ngram_covered(stream, full.starts) if setting.head_rows else None
    for seen in range(setting.interval, n + 1, setting.interval):
        so_far = seq_of < seen
        if setting.holdout == "requests":
            cut = seen - max(1, round(0.2 * seen))
            held = so_far & (seq_of >= cut)
        else:
            held = so_far & in_holdout
        rows = so_far & ~held
        if covered is not None:
            rows &= ~covered
        starts, held_starts = full.starts[rows], full.starts[held]
        candidate = head.clone()
        opt = torch.optim.AdamW([p for p in candidate.parameters() if p.is_floating_point()], lr=setting.lr)
        if optimizer is not None:
            opt.load_state_dict(optimizer)
            for group in opt.param_groups:
                group["lr"] = setting.lr
        steps = setting.steps if not setting.epoch_cap else max(1, min(setting.steps, math.ceil(len(starts) / setting.batch)))
        task = ChainTask(stream, ChainConfig(generated_only=True))
        batches = (starts[torch.randint(len(starts), (min(setting.batch, len(starts)),), generator=generator)].tolist() for _ in range(steps))
        run_steps(candidate, opt, lambda model, o, chunk: task.step(model, o, chunk, DistillConfig()), batches)
        before, after = gate_alpha(head, stream, held_starts), gate_alpha(candidate, stream, held_starts)
        passed = after >= before
        truth_before = alpha(replay_acceptance(head, heldout, 4, ngram=(3, 2)))
        truth_after = alpha(replay_acceptance(candidate, heldout, 4, ngram=(3, 2)))
        gate_log.append({"seen": seen, "gate": [round(before, 4), round(after, 4)], "truth": [round(truth_before, 4), round(truth_after, 4)],
                         "published": passed})
        if passed:
            head, optimizer = candidate, opt.state_dict()
            published += 1
        else:
            refused += 1
    agree = sum((g["gate"][1] >= g["gate"][0]) == (g["truth"][1] >= g["truth"][0]) for g in gate_log)
    return {"setting": setting.name, "published": published, "refused": refused,
            "heldout_hybrid_alpha": alpha(replay_acceptance(head, heldout, 4, ngram=(3, 2))),
            "heldout_head_alpha": alpha(replay_acceptance(head, heldout, 4)),
            "candidates_that_helped": sum(g["truth"][1] > g["truth"][0] for g in gate_log),
            "gate_agrees_with_truth": agree, "updates": len(gate_log), "log": gate_log}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", default="stdlib")
    parser.add_argument("--stream", type=int, default=100, help="online-split requests learned from")
    parser.add_argument("--heldout", type=int, default=40, help="held-out-split requests the truth is measured on")
    parser.add_argument("--only", default=None, help="comma-separated setting names (default: all)")
    parser.add_argument("--out", type=Path, default=Path("docs/gate-experiments"))
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_model("default")
    pool = stream_pools([args.domain])[args.domain]
    config = SignalConfig(max_new_tokens=NEW_TOKENS)
    stream = build_signal(target.model, target.tokenizer, split(pool, "online")[: args.stream], config, cache_as="default")
    heldout = build_signal(target.model, target.tokenizer, split(pool, "heldout")[: args.heldout], config, cache_as="default")
    start = load_head(DEFAULT_HEAD, target)
    packaged = {"hybrid": alpha(replay_acceptance(start, heldout, 4, ngram=(3, 2))), "head": alpha(replay_acceptance(start, heldout, 4))}
    chosen = [s for s in SETTINGS if args.only is None or s.name in args.only.split(",")]
    results = []
    for setting in chosen:
        began = time.time()
        results.append(run(setting, start, stream, heldout))
        r = results[-1]
        print(f"{setting.name}: published {r['published']}/{r['updates']}, held-out hybrid alpha {packaged['hybrid']:.3f} -> "
              f"{r['heldout_hybrid_alpha']:.3f}, head {packaged['head']:.3f} -> {r['heldout_head_alpha']:.3f}, "
              f"gate agreed with the truth {r['gate_agrees_with_truth']}/{r['updates']} ({time.time() - began:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"packaged": packaged, "results": results}, indent=1))
    lines = [
        f"| hypothesis (one change from baseline) | published / candidates | candidates that helped (truth) | gate agreed with truth | "
        f"held-out hybrid alpha (packaged {packaged['hybrid']:.3f}) | held-out head alpha (packaged {packaged['head']:.3f}) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['setting']} | {r['published']} / {r['updates']} | {r['candidates_that_helped']} / {r['updates']} | "
                     f"{r['gate_agrees_with_truth']} / {r['updates']} | {r['heldout_hybrid_alpha']:.3f} | {r['heldout_head_alpha']:.3f} |")
    header = (f"Command: `python bench/gate_experiments.py --domain {args.domain} --stream {args.stream} --heldout {args.heldout}`; "
              f"{platform.platform()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.")
    args.out.with_suffix(".md").write_text(header + "\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
