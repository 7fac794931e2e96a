"""A head born from the target: does it learn faster from its own domain's records, or from
every domain's (one draft shared), and from more optimizer steps?

Replays a server's replay buffers (``out-dir/buffer/<domain>``, records of the default target's
verifications, in arrival order), offline, on the default target: for each domain the records of
its first ``--train`` requests train, those of its last ``--eval`` requests judge (step-1
acceptance alpha and agreement, the gate's figures). Arms, each a fresh head
(:meth:`FeatureHead.fresh`, its vocabulary chosen from its training records, the learner's
``cold_lr``, batches of 32):

- ``own``: one head per domain, ``--steps`` optimizer steps on its domain's records (what the
  default ``--router domain`` gives each draft by request ``3 * train``);
- ``shared``: one head for all, ``3 * --steps`` steps on every domain's records (``--router single``:
  three times the updates over the same requests);
- ``own x4``, ``shared x4``: four times the steps (a cold head given the idle time it could use);
- ``packaged``: the packaged head (distilled offline on 2.66 M tokens), untrained here: the
  reference a fresh head is measured against.

    python bench/fresh_head_data.py runs/cold-start/fresh/buffer      # ~15 min on 2 cores
    python bench/fresh_head_data.py runs/cold-start/fresh/buffer --arms packaged,own
    python bench/fresh_head_data.py runs/cold-start-gemma/fresh/buffer --arms untrained,shared --steps 480 \
        --target GEMMA.gguf --json docs/results/fresh-head-data-gemma.json     # another target's buffer

Prints a table and writes docs/results/fresh-head-data.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from onlinespec.distill.step import DistillConfig
from onlinespec.factory import DEFAULT_HEAD, fresh_head, load_head
from onlinespec.models import load_target
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learnable import HeadDraft
from onlinespec.online.learner import LearnerConfig

ARMS = ("untrained", "packaged", "own", "shared", "own x4", "shared x4")
DOCS = harness.RESULTS


def by_request(records: list) -> list[list]:
    """Records grouped by request, in arrival order."""
    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault(r.request_id, []).append(r)
    return list(groups.values())


def train(target, records: list, steps: int, config: LearnerConfig, seed: int = 0):
    torch.manual_seed(seed)
    draft = HeadDraft()
    head = fresh_head(target)
    draft.adapt(head, records)
    objective = draft.objective(records, config.position_policy, config.chain_depth, config.distill)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.is_floating_point() and p.requires_grad], lr=config.cold_lr)
    for _ in range(steps):
        batch = [objective.examples[j] for j in torch.randint(len(objective.examples), (config.batch_size,)).tolist()]
        objective.step(head, optimizer, batch)
    return head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("buffers", type=Path, help="a server's out-dir/buffer (one folder per domain)")
    parser.add_argument("--train", type=int, default=100, help="requests per domain that train")
    parser.add_argument("--eval", type=int, default=80, help="last requests per domain that judge")
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps of a per-domain head (4 updates of 40)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    parser.add_argument("--target", default="default", help="the target whose verifications the buffers hold")
    parser.add_argument("--json", type=Path, default=DOCS / "fresh-head-data.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_target(args.target)
    config, distill = LearnerConfig(), DistillConfig()
    domains = sorted(p.name for p in args.buffers.iterdir() if p.is_dir())
    requests = {d: by_request(ReplayBuffer(args.buffers / d).records()) for d in domains}
    short = {d: len(v) for d, v in requests.items() if len(v) < args.train + args.eval}
    if short:  # the judged requests would include trained ones, and flatter every trained arm
        sys.exit(f"{short}: fewer requests than --train {args.train} + --eval {args.eval}; lower them")
    trains = {d: [r for req in requests[d][: args.train] for r in req] for d in domains}
    evals = {d: [r for req in requests[d][-args.eval:] for r in req] for d in domains}
    out = {"requests": {d: len(v) for d, v in requests.items()}, "arms": {}}
    started = time.perf_counter()

    def judge(arm: str, heads: dict) -> None:
        out["arms"][arm] = {d: HeadDraft().metrics(heads[d], evals[d], distill) for d in domains}
        row = ", ".join(f"{d} alpha {m['alpha']:.3f}" for d, m in out["arms"][arm].items())
        print(f"{arm:10s} {row}  ({time.perf_counter() - started:.0f} s)", flush=True)

    every = [r for d in domains for r in trains[d]]
    arms = {
        "untrained": lambda: {d: train(target, trains[d], 0, config) for d in domains},
        "packaged": lambda: dict.fromkeys(domains, load_head(DEFAULT_HEAD, target)),
        "own": lambda: {d: train(target, trains[d], args.steps, config) for d in domains},
        "shared": lambda: dict.fromkeys(domains, train(target, every, len(domains) * args.steps, config)),
        "own x4": lambda: {d: train(target, trains[d], 4 * args.steps, config) for d in domains},
        "shared x4": lambda: dict.fromkeys(domains, train(target, every, 4 * len(domains) * args.steps, config)),
    }
    for arm in args.arms.split(","):
        judge(arm, arms[arm]())
    path = args.json
    if path.exists():  # arms run before (another --arms) are kept
        out["arms"] = {**json.loads(path.read_text()).get("arms", {}), **out["arms"]}
    harness.write_result(path, out)


if __name__ == "__main__":
    main()
