"""Offline simulation of online learning on one domain of the experiments' stream (fast tuning).

Every I requests, S steps of batch B at learning rate LR on all of the domain's answers so far
(the target's greedy answers, as the online recorder keeps them), then the next I requests are
scored by replaying speculative decoding (k = 4), beside the starting head on the same requests. ``fresh`` builds a new AdamW for every update,
as the learner did before it carried the optimizer state on.

    python bench/online_sim.py I S B LR DOMAIN [fresh] [packaged] [hybrid]    # e.g. 25 40 64 1e-3 code: ~1 min

``packaged`` starts from the packaged default head instead of the experiments' chat-only head.
``hybrid`` scores the blocks as the default draft serves them: n-gram lookup where the text
offers a match, the head elsewhere; it also prints each drafter's acceptance. ``headrows`` trains
only on the positions where the hybrid would ask the head (no n-gram match in the text so far).

Needs the stream's signal (the first stage of bench/online_experiments.py builds and caches it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online_experiments import original_head, streams, teacher_signal  # noqa: E402

from onlinespec.decoding.proposers.ngram import lookup  # noqa: E402
from onlinespec.distill.loop import run_steps  # noqa: E402
from onlinespec.distill.step import DistillConfig  # noqa: E402
from onlinespec.drafts.train import ChainConfig, ChainTask, replay_acceptance  # noqa: E402
from onlinespec.factory import DEFAULT_HEAD, load_head  # noqa: E402
from onlinespec.models import load_model  # noqa: E402


def ngram_covered(signal, starts: torch.Tensor) -> torch.Tensor:
    """[len(starts)]: whether a round drafting from start ``t`` (proposing token ``t + 2``) would
    be proposed by n-gram lookup in the hybrid, not by the head."""
    ids, seq = signal.ids.numpy(), signal.sequence_of()
    begins = signal.starts[seq[starts]]
    return torch.tensor([bool(lookup(ids[int(b): int(t) + 2], 1, 3, 2)) for b, t in zip(begins, starts)])


def main() -> None:
    interval, steps, batch, lr, domain = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    fresh, packaged, hybrid, headrows = (w in sys.argv[6:] for w in ("fresh", "packaged", "hybrid", "headrows"))
    target = load_model("default", "float32")
    signal = teacher_signal(target, streams(target.tokenizer)[0])
    index = [i for i, d in enumerate(signal.domains) if d == domain]
    head = load_head(DEFAULT_HEAD if packaged else original_head(target), target)
    static = head.clone()  # the starting head, never trained: each block's baseline
    make = lambda: torch.optim.AdamW(head.parameters(), lr=lr)  # noqa: E731
    optimizer, generator, curve, baseline, started = make(), torch.Generator().manual_seed(0), [], [], time.time()
    alpha = lambda scored: sum(a for a, _ in scored) / sum(j for _, j in scored)  # noqa: E731
    drafters = {"learned": {}, "static": {}}
    for start in range(0, len(index), interval):
        block = signal.select(index[start: start + interval])
        ngram = (3, 2) if hybrid else None
        curve.append(alpha(replay_acceptance(head, block, 4, ngram=ngram, by_drafter=drafters["learned"] if start else None)))
        baseline.append(alpha(replay_acceptance(static, block, 4, ngram=ngram, by_drafter=drafters["static"] if start else None)))
        task = ChainTask(signal.select(index[: start + interval]), ChainConfig(generated_only=True))
        if headrows:
            task.starts = task.starts[~ngram_covered(task.signal, task.starts)]
        if fresh:
            optimizer = make()
        batches = (task.starts[torch.randint(len(task), (batch,), generator=generator)].tolist() for _ in range(steps))
        run_steps(head, optimizer, lambda model, opt, chunk: task.step(model, opt, chunk, DistillConfig()), batches)
    print(interval, steps, batch, lr, domain, "fresh" if fresh else "persistent", "packaged head" if packaged else "chat-only head", "hybrid" if hybrid else "head alone", "head rows only" if headrows else "all rows", " ".join(f"{c:.3f}" for c in curve),
          f"{time.time() - started:.0f} s")
    print("static head, same blocks:", " ".join(f"{c:.3f}" for c in baseline))
    print(f"learned - static: mean over blocks 2.. {sum(c - b for c, b in zip(curve[1:], baseline[1:])) / max(1, len(curve) - 1):+.3f}, "
          f"last 4 blocks {sum(c - b for c, b in zip(curve[-4:], baseline[-4:])) / 4:+.3f}")
    for name, tally in drafters.items():  # blocks 2..: [accepted, judged] per drafter
        print(f"{name}, blocks 2.. by drafter:", ", ".join(f"{drafter} {a / j:.3f} of {j} judged" for drafter, (a, j) in sorted(tally.items())))


if __name__ == "__main__":
    main()
