"""How long the learner's units of work are: what a serving step may wait for when it gives a turn.

Learning runs in the engine's turns (docs/online-learning.md): a turn ends at the first pause
point after about 50 ms, and a unit of work between two pause points is never cut, so the longest
unit is the longest a running request's step can stall. This times each unit of one update of the
packaged head on a real replay buffer (a server's ``out-dir/buffer/<draft>``), on the default
target, as the learner runs it: building the training examples, one optimizer step, and the gate's
held-out evaluation, as one unit (before) and chunk by chunk (after: ``between`` pause points).

    python bench/turn_units.py runs/cold-start/packaged/buffer/chat     # ~1 min on 2 cores

Prints a table and writes docs/results/turn-units.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

import harness

from onlinespec.distill.step import DistillConfig
from onlinespec.factory import DEFAULT_HEAD, load_head
from onlinespec.models import load_target
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learnable import HeadDraft
from onlinespec.online.learner import LearnerConfig

DOCS = harness.RESULTS


def main(folder: str) -> None:
    torch.set_num_threads(2)
    target = load_target("default")
    head = load_head(DEFAULT_HEAD, target)
    records = ReplayBuffer(folder).records()
    config, draft, distill = LearnerConfig(), HeadDraft(), DistillConfig()
    held = records[-max(1, int(len(records) * 0.2)):]  # the gate's newest 20% (one domain)
    train = records[: len(records) - len(held)]
    out = {"records": len(records), "held_out": len(held)}

    start = time.perf_counter()
    objective = draft.objective(train, config.position_policy, config.chain_depth, config.distill)
    candidate = draft.copy(head)
    draft.adapt(candidate, train)
    out["build_examples_s"] = time.perf_counter() - start
    out["examples"] = len(objective.examples)

    optimizer = torch.optim.AdamW([p for p in candidate.parameters() if p.is_floating_point()], lr=config.lr)
    steps = []
    for i in range(6):
        batch = [objective.examples[j] for j in torch.randint(len(objective.examples), (config.batch_size,)).tolist()]
        began = time.perf_counter()
        objective.step(candidate, optimizer, batch)
        steps.append(time.perf_counter() - began)
    out["optimizer_step_s"] = sorted(steps[1:])[len(steps[1:]) // 2]  # the median after the first

    began = time.perf_counter()
    whole = draft.metrics(candidate, held, distill)
    out["gate_evaluation_one_unit_s"] = time.perf_counter() - began
    marks = [time.perf_counter()]
    chunked = draft.metrics(candidate, held, distill, between=lambda: marks.append(time.perf_counter()))
    pieces = [b - a for a, b in itertools.pairwise(marks)]
    out["gate_evaluation_chunks"] = len(pieces)
    out["gate_evaluation_longest_chunk_s"] = max(pieces)
    assert abs(whole["alpha"] - chunked["alpha"]) < 1e-6  # the same figures, in pieces
    harness.write_result(DOCS / "turn-units.json", out)
    print(f"{len(records)} records ({len(held)} held out), {out['examples']} examples")
    for key in ("build_examples_s", "optimizer_step_s", "gate_evaluation_one_unit_s", "gate_evaluation_longest_chunk_s"):
        print(f"{key:36s} {out[key]:.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
