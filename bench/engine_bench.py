"""Engine benchmark: target alone vs onlinespec vs HF assisted generation, on real prompts.

Exports 60 packaged real prompts (20 chat, 20 code, 20 math), runs `onlinespec bench` for each
draft configuration, and writes docs/results/engine-bench.md (tables with the exact commands, the machine
and the date) and docs/results/engine-bench.png (tokens/s by domain, the three methods side by side).

    python bench/engine_bench.py                       # all configurations (about 33 min on 2 cores)
    python bench/engine_bench.py --configs ngram:3     # one configuration, draft:k
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

ROOT = harness.ROOT
RUNS = harness.RUNS / "engine-bench"
DOCS = harness.RESULTS
CONFIGS = ["target-layers:2:2", "ngram:2", "ngram:4"]  # draft spec, then k after the last colon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="draft:k pairs, e.g. ngram:3")
    parser.add_argument("--n", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--report-only", action="store_true", help="rewrite docs/results/ from the JSON of an earlier run")
    args = parser.parse_args()

    RUNS.mkdir(parents=True, exist_ok=True)
    prompts = RUNS / "prompts.jsonl"
    cli = [sys.executable, "-m", "onlinespec.cli"]
    if not args.report_only:
        subprocess.run([*cli, "data", "export", "--n", str(args.n), "--out", str(prompts), "--seed", "0"], check=True)
    summaries = []
    for config in args.configs:
        draft, k = config.rsplit(":", 1)
        out = RUNS / f"{draft.replace(':', '-')}-k{k}-{args.dtype}.json"
        if args.report_only:
            summaries.append(json.loads(out.read_text()))
            continue
        command = [*cli, "bench", "--prompts", str(prompts), "--json", str(out), "--draft", draft, "--k", k,
                   "--dtype", args.dtype, "--max-new-tokens", str(args.max_new_tokens)]
        subprocess.run(command, check=True)
        summaries.append(json.loads(out.read_text()))
    write_report(summaries, args)


def write_report(summaries: list[dict], args: argparse.Namespace) -> None:
    DOCS.mkdir(parents=True, exist_ok=True)
    machine = summaries[0]["machine"]
    lines = [
        "# Engine benchmark: target alone vs onlinespec vs Hugging Face assisted generation",
        "",
        (f"Machine: {machine['platform']}, {machine['cpu_count']} CPUs, torch {machine['torch']} "
        f"({machine['torch_threads']} threads), Python {machine['python']}. Date: {machine['date']}."),
        (f"Target: the packaged default (SmolLM2-135M-Instruct, {args.dtype}). "
        f"{summaries[0]['n_prompts']} packaged real prompts, greedy, {args.max_new_tokens} new tokens at most."),
        "The three methods run interleaved prompt by prompt in one process (order rotated per prompt).",
        "tokens/s = all new tokens / all seconds; `median` columns are medians of per-prompt ratios.",
        "",
        "Reproduce: `python bench/engine_bench.py` (raw JSON in `runs/engine-bench/`).",
        "",
    ]
    for s in summaries:
        lines += _section(s)
    (DOCS / "engine-bench.md").write_text("\n".join(lines) + "\n")
    _plot(summaries, DOCS / "engine-bench.png")
    print(f"wrote {DOCS / 'engine-bench.md'} and {DOCS / 'engine-bench.png'}")


def _section(s: dict) -> list[str]:
    cost = s.get("cost_model", {})
    spec = s["speculative"]
    lines = [
        f"## draft `{s['draft']}`, k = {s['k']}",
        "",
        f"Command: `{s.get('command', '').replace(str(ROOT) + '/', '')}`",
        "",
        ("| domain | n | target alone tok/s | ours tok/s | HF assisted tok/s | alpha | tau | ours / target | "
        "median | ours / HF | median | predicted | greedy identical |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, fig in [("all", s), *s["domains"].items()]:
        sp = fig["speculative"]
        hf = fig.get("hf_assisted")
        lines.append(
            f"| {name} | {fig['n_prompts']} | {fig['target_alone']['tokens_per_s']:.1f} | {sp['tokens_per_s']:.1f} | "
            f"{_num(hf and hf['tokens_per_s'], '.1f')} | {sp['acceptance_rate']:.3f} | {sp['mean_accepted_length']:.2f} | "
            f"{fig['speedup_vs_target']:.2f}x | {fig['median_speedup_vs_target']:.2f}x | {_num(fig.get('speedup_vs_hf'), '.2f', 'x')} | "
            f"{_num(fig.get('median_speedup_vs_hf'), '.2f', 'x')} | {fig.get('predicted_speedup', float('nan')):.2f}x | "
            f"{sp.get('greedy_identical', '-')}/{fig['n_prompts']} |"
        )
    if cost:
        err = s["speedup_vs_target"] / cost["predicted_speedup"] - 1
        lines += [
            "",
            (f"Cost model from this run: alpha {cost['alpha']:.3f}, c {cost['c']:.3f}, verify pass "
            f"{cost['verify_cost']:.2f}x a target step -> predicted speedup {cost['predicted_speedup']:.2f}x, "
            f"measured {s['speedup_vs_target']:.2f}x ({err:+.1%}); the paper's formula with verify = 1 says "
            f"{cost['paper_predicted_speedup']:.2f}x."),
        ]
    lines += [
        (f"Engine overhead (everything outside model forwards): {spec['engine_overhead_fraction']:.2%} of request time. "
        f"Divergent greedy outputs all near-ties: {spec.get('divergences_all_near_ties')}."),
        "",
    ]
    return lines


def _num(value, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def _plot(summaries: list[dict], path: Path) -> None:
    cols = min(3, len(summaries))
    rows = (len(summaries) + cols - 1) // cols
    fig, axes = harness.figure(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    methods = [("target_alone", "target alone"), ("speculative", "onlinespec"), ("hf_assisted", "HF assisted")]
    for ax, s in zip(axes.flat, summaries):
        domains = ["all", *s["domains"]]
        figs = [s, *s["domains"].values()]
        width = 0.27
        for j, (key, label) in enumerate(methods):
            if key not in s:
                continue
            ax.bar([i + (j - 1) * width for i in range(len(domains))], [f[key]["tokens_per_s"] for f in figs], width, label=label)
        ax.set_xticks(range(len(domains)), domains)
        cfg = s.get("config", {})
        flags = [cfg.get("dtype", "")] + (["adaptive k"] if cfg.get("adaptive_k") else [])
        if cfg.get("dtype") == "float32" and not s.get("small_batch_kernels_on", False):
            flags.append("stock kernels")
        ax.set_title(f"draft {s['draft']}, k={s['k']} ({', '.join(f for f in flags if f)})\n{s['speedup_vs_target']:.2f}x target alone", fontsize=10)
        ax.set_ylabel("tokens/s (greedy)")
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(summaries):]:
        ax.axis("off")
    harness.save(fig, path, dpi=110)


if __name__ == "__main__":
    main()
