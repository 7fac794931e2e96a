"""What the background learner costs serving, and how fast it learns, per CPU budget.

The default draft serves the same online-split prompts over and over (greedy, 64 new tokens,
fp32) while the real online learner (feature-head chain training on records from real traces)
runs an endless update under each budget, in interleaved blocks:

- ``off``: no learner;
- ``low``: the learner thread at nice 19 (the default): it gets only the CPU time serving leaves;
- ``normal, share s``: normal priority, computing at most a share ``s`` of wall time.

    python bench/learner_overhead.py        # ~6 min on 2 CPU cores; run it on a quiet machine

Writes docs/results/learner-overhead.md (docs/learner-overhead.md quotes it).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from onlinespec.data import packaged_prompts
from onlinespec.decoding.engine import DEFAULT_K
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.factory import DEFAULT_DRAFT, engine_options, make_proposer
from onlinespec.models import load_model
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.learner import LearnerConfig, OnlineLearner
from onlinespec.online.registry import DraftRegistry

DOCS = Path(__file__).resolve().parents[1] / "docs" / "results"
BUDGETS = {"off": None, "low": {"priority": "low"}, "normal, share 0.15": {"priority": "normal", "cpu_share": 0.15},
           "normal, share 1": {"priority": "normal", "cpu_share": 1.0}}
REPEATS = 3


def main() -> None:
    target = load_model("default", "float32")
    proposer = make_proposer(DEFAULT_DRAFT, target).proposer
    decoder = SpeculativeDecoder(target.model, target.tokenizer, proposer, k=DEFAULT_K,
                                 **engine_options(target, DEFAULT_K, adaptive=True))
    params = SamplingParams(max_new_tokens=64)
    warm, served = packaged_prompts(24, split="online", seed=3)[:16], packaged_prompts(24, split="online", seed=3)[16:]
    work = Path(tempfile.mkdtemp(prefix="learner-overhead-"))
    learner = OnlineLearner(proposer, ReplayBuffer(work / "buffer", "window"), DraftRegistry(work / "drafts"),
                            LearnerConfig(update_interval=10**9, steps_per_update=10**9, batch_size=64, position_policy="verified"))
    for query in warm:  # real records to learn from
        learner.observe(decoder.generate(list(query.messages), params, trace=True), query.domain, query.id)
    results = {name: {"tokens_per_s": [], "steps_per_s": []} for name in BUDGETS}
    for repeat in range(REPEATS):
        for name, budget in BUDGETS.items():
            if budget:
                learner.config = dataclasses.replace(learner.config, **budget)
                learner.start_update()
            steps, start = learner.steps_done, time.perf_counter()
            rates = [decoder.generate(list(q.messages), params).stats.tokens_per_s for q in served]
            elapsed = time.perf_counter() - start
            learner.stop()
            results[name]["tokens_per_s"].append(statistics.median(rates))
            results[name]["steps_per_s"].append((learner.steps_done - steps) / elapsed)
            print(f"repeat {repeat} {name:20s} serving {statistics.median(rates):5.1f} tok/s, learner {results[name]['steps_per_s'][-1]:.2f} steps/s", flush=True)
    off = statistics.median(results["off"]["tokens_per_s"])
    lines = ["# What the background learner costs serving", "",
             f"Command: `python bench/learner_overhead.py` ({time.strftime('%Y-%m-%d')}, 2 CPU cores, fp32 target, default "
             f"draft `{DEFAULT_DRAFT}` k = {DEFAULT_K} adaptive, 64 new tokens, {len(served)} online-split prompts per block, "
             f"{REPEATS} interleaved repeats; the learner trains the feature head on chains of batch 64 with 1 torch thread).", "",
             "| learner budget | serving tok/s (median of block medians) | vs learner off | learner steps/s |", "|---|---|---|---|"]
    for name, r in results.items():
        tps = statistics.median(r["tokens_per_s"])
        lines.append(f"| {name} | {tps:.1f} | {tps / off:.0%} | {statistics.median(r['steps_per_s']):.2f} |")
    lines += ["", "Serving saturates both cores, so a learner at normal priority takes its time from serving; at nice 19 "
              "it only runs in the gaps, and serving keeps its speed while learning slows down. The default is `low`."]
    (DOCS / "learner-overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
