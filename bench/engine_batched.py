"""The batched engine, measured: docs/engine-batched.md and its plots.

    python bench/engine_batched.py                      # ~35 min on 2 cores
    python bench/engine_batched.py --n 8 --long 4 --levels 1,2 --new-tokens 16 --out /tmp/eb   # a smoke run

Three parts, each with everything it compares run side by side in one process:

1. **concurrency 1, new engine vs the batch-1 engine it replaced** (the package as it was at
   ``--legacy``, extracted from git into a temporary folder and imported under another name),
   sharing one target model; the two serve every held-out prompt alternately first;
2. **held-out prompts at each concurrency level** (``onlinespec bench --concurrency``): the target
   alone and the default draft, both batched by the same engine and scheduler;
3. **long prompts** (standard-library code to complete and documentation to summarise, 258-703
   tokens) at each level: where attention grows the verify cost.

Greedy outputs are compared with the target alone's at concurrency 1 (near-tie rule as in
``onlinespec bench``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

ROOT = harness.ROOT
LEGACY_REV = "8e019d5"  # the last commit of the batch-1 engine


def load_legacy(rev: str):
    """The ``onlinespec`` package at git revision ``rev``, importable as ``onlinespec_legacy``."""
    folder = Path(tempfile.mkdtemp(prefix="onlinespec-legacy-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src/onlinespec"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    package = folder / "onlinespec_legacy"
    (folder / "src" / "onlinespec").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\bonlinespec\.", "onlinespec_legacy.", path.read_text()).replace("from onlinespec import", "from onlinespec_legacy import"))
    sys.path.insert(0, str(folder))
    return importlib.import_module("onlinespec_legacy")


def compare_with_legacy(target, queries, new_tokens: int, rev: str) -> dict:
    """Tokens/s of the new engine over the legacy one at concurrency 1, prompt by prompt."""
    from onlinespec.decoding.engine import DEFAULT_K
    from onlinespec.decoding.sampling import SamplingParams
    from onlinespec.decoding.speculative import SpeculativeDecoder
    from onlinespec.factory import DEFAULT_DRAFT, engine_options, make_proposer

    load_legacy(rev)
    legacy_api = importlib.import_module("onlinespec_legacy.api")
    legacy_engine = importlib.import_module("onlinespec_legacy.decoding.speculative")
    legacy_sampling = importlib.import_module("onlinespec_legacy.decoding.sampling")
    options = engine_options(target, DEFAULT_K, adaptive=True, max_batch=1)  # decides the kernels for both
    new = SpeculativeDecoder(target.model, target.tokenizer, make_proposer(DEFAULT_DRAFT, target).proposer, k=DEFAULT_K, **options)
    old_options = legacy_api.engine_options(target, DEFAULT_K, adaptive=True, kernels=False)
    old = legacy_engine.SpeculativeDecoder(target.model, target.tokenizer, legacy_api.make_proposer(DEFAULT_DRAFT, target).proposer,
                                           k=DEFAULT_K, **old_options)
    params, old_params = SamplingParams(max_new_tokens=new_tokens), legacy_sampling.SamplingParams(max_new_tokens=new_tokens)
    prompt = lambda q: list(q.messages) if q.messages else q.prompt
    new.generate(prompt(queries[0]), SamplingParams(max_new_tokens=8))
    old.generate(prompt(queries[0]), legacy_sampling.SamplingParams(max_new_tokens=8))
    rows = []
    for i, q in enumerate(queries):
        runs = {}
        for name in (["new", "legacy"] if i % 2 == 0 else ["legacy", "new"]):
            start = time.perf_counter()
            out = new.generate(prompt(q), params) if name == "new" else old.generate(prompt(q), old_params)
            runs[name] = (len(out.token_ids), time.perf_counter() - start, out.token_ids)
        rows.append({"id": q.id, **{f"{n}_tokens": runs[n][0] for n in runs}, **{f"{n}_seconds": runs[n][1] for n in runs},
                     "identical": runs["new"][2] == runs["legacy"][2]})
    rate = lambda rs, n: sum(r[f"{n}_tokens"] for r in rs) / sum(r[f"{n}_seconds"] for r in rs)
    ratio = lambda rs: rate(rs, "new") / rate(rs, "legacy")
    rng = random.Random(0)
    boot = sorted(ratio([rng.choice(rows) for _ in rows]) for _ in range(2000))
    per_prompt = sorted((r["new_tokens"] / r["new_seconds"]) / (r["legacy_tokens"] / r["legacy_seconds"]) for r in rows)
    return {"rev": rev, "new_tokens_per_s": rate(rows, "new"), "legacy_tokens_per_s": rate(rows, "legacy"),
            "ratio": ratio(rows), "ratio_95ci": [boot[49], boot[1949]], "median_ratio": per_prompt[len(per_prompt) // 2],
            "identical": sum(r["identical"] for r in rows), "n": len(rows), "prompts": rows}


def tables(report: dict) -> str:
    """The report's figures as Markdown tables (for docs/engine-batched.md)."""
    lines = []
    legacy = report.get("legacy")
    if legacy:
        lo, hi = legacy["ratio_95ci"]
        lines += [(f"Concurrency 1, new engine / batch-1 engine at {legacy['rev']}: {legacy['new_tokens_per_s']:.1f} / "
                  f"{legacy['legacy_tokens_per_s']:.1f} tok/s = **{legacy['ratio']:.3f}x** (95% bootstrap interval "
                  f"{lo:.3f}-{hi:.3f}; median per prompt {legacy['median_ratio']:.3f}); identical outputs "
                  f"{legacy['identical']}/{legacy['n']}."), ""]
    for part in ("short", "long"):
        if part not in report:
            continue
        summary = report[part]
        lines += [(f"**{'held-out' if part == 'short' else 'long'} prompts** ({summary['n_prompts']}, "
                  f"{summary['config']['max_new_tokens']} new tokens, greedy, fp32):"), "",
                  ("| in flight | target alone tok/s | speculative tok/s | speedup | predicted | pred. error | "
                  "latency p50 / p99 s (alone) | latency p50 / p99 s (spec.) | TTFT p50 / p99 s (spec.) | alpha | tau | mean k | "
                  "speculating share | mean batch | context | identical (alone / spec.) |"),
                  "|" + "---|" * 16]
        for level, fig in summary["concurrency"].items():
            a, s = fig["target_alone"], fig["speculative"]
            pred = fig.get("predicted_speedup")
            err = f"{100 * (pred / fig['speedup_vs_target'] - 1):+.0f}%" if pred else "-"
            lines.append(
                f"| {level} | {a['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} | **{fig['speedup_vs_target']:.2f}x** | "
                f"{pred:.2f}x | {err} | {a['latency_p50_s']:.2f} / {a['latency_p99_s']:.2f} | {s['latency_p50_s']:.2f} / "
                f"{s['latency_p99_s']:.2f} | {s['ttft_p50_s']:.2f} / {s['ttft_p99_s']:.2f} | {s['acceptance_rate']:.3f} | "
                f"{s['tau']:.2f} | {s['mean_k']:.2f} | {s['speculating_share']:.2f} | {s['mean_batch']:.2f} | "
                f"{s['mean_context']:.0f} | {a.get('greedy_identical', '-')} / {s.get('greedy_identical', '-')} |")
        first = summary["concurrency"].get("1")
        if first and "8" in summary["concurrency"]:
            scale = summary["concurrency"]["8"]["target_alone"]["tokens_per_s"] / first["target_alone"]["tokens_per_s"]
            lines += ["", f"Target alone at 8 in flight: {scale:.2f}x its own throughput at 1."]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="held-out prompts")
    parser.add_argument("--long", type=int, default=16, help="long prompts (0: skip)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--levels", default="1,2,4,8")
    parser.add_argument("--legacy", default=LEGACY_REV, help="git revision of the engine to compare with at concurrency 1 ('' to skip)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--report-only", action="store_true", help="print the tables of runs/engine-batched/report.json")
    args = parser.parse_args()
    if args.report_only:  # tables and plots again from the last run
        sys.path.insert(0, str(ROOT / "src"))
        from onlinespec.benchmark import plot_concurrency

        report = json.loads((ROOT / "runs" / "engine-batched" / "report.json").read_text())
        for part, name in (("short", "engine-batched.png"), ("long", "engine-batched-long.png")):
            if part in report:
                plot_concurrency(report[part], args.out / name)
        print(tables(report))
        return
    sys.path.insert(0, str(ROOT / "src"))
    from onlinespec.benchmark import BenchConfig, plot_concurrency, run_concurrency_bench
    from onlinespec.data import long_prompts, packaged_prompts
    from onlinespec.models import load_model

    args.out.mkdir(parents=True, exist_ok=True)
    runs = ROOT / "runs" / "engine-batched"
    runs.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.levels.split(",")]
    target = load_model("default", "float32")
    held_out = packaged_prompts(args.n, seed=0, split="heldout")
    config = BenchConfig(max_new_tokens=args.new_tokens, hf_assisted=False)
    report = {"command": shlex.join(["python", "bench/engine_batched.py", *sys.argv[1:]]), "machine": harness.machine()}

    def progress(level, method, fig):
        print(f"  concurrency {level} {method}: {fig['tokens_per_s']:.1f} tok/s, alpha {fig['acceptance_rate']:.3f}, "
              f"mean k {fig['mean_k']:.2f}, mean batch {fig['mean_batch']:.2f}", flush=True)

    if args.legacy:
        print(f"part 1: concurrency 1, new engine vs {args.legacy}, {len(held_out)} prompts", flush=True)
        report["legacy"] = compare_with_legacy(target, held_out, args.new_tokens, args.legacy)
        print(f"  new/legacy {report['legacy']['ratio']:.3f} (95% {report['legacy']['ratio_95ci']})", flush=True)
    print(f"part 2: {len(held_out)} held-out prompts at concurrency {levels}", flush=True)
    report["short"] = run_concurrency_bench(held_out, config, levels, target, on_level=progress)
    plot_concurrency(report["short"], args.out / "engine-batched.png")
    if args.long:
        print(f"part 3: {args.long} long prompts at concurrency {levels}", flush=True)
        report["long"] = run_concurrency_bench(long_prompts(args.long), config, levels, target, on_level=progress)
        plot_concurrency(report["long"], args.out / "engine-batched-long.png")
    harness.write_result(runs / "report.json", report)
    harness.write_result(args.out / "engine-batched.json", {k: v for k, v in report.items() if k != "legacy"} |
                         {"legacy": {k: v for k, v in report.get("legacy", {}).items() if k != "prompts"}})
    print(tables(report))
    print(f"wrote {runs / 'report.json'} and the plots in {args.out}")


if __name__ == "__main__":
    main()
