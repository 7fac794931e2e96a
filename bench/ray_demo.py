"""The README's main job served two ways, one after the other: one process, and two replicas on Ray.

Runs `onlinespec demo` (the real default target, the online split's stream with a domain shift,
the `openai` client, 4 requests in flight, the learner running, every other request also served
by the static draft and, after the stream, by the target alone) with and without `--replicas 2`,
then compares them: output identical to the target alone, and how the new domain's alpha moves
while its draft learns, in each.

    python bench/ray_demo.py                  # 80 maths, 20 code, 20 chat requests each (~15 min here)
    python bench/ray_demo.py --report-only    # rewrite the JSON and the PNG from the two runs

Writes docs/results/ray-demo.json and docs/results/ray-demo.png; docs/scale.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

DOCS = harness.RESULTS
RUNS = {"one process": [], "2 replicas on Ray": ["--replicas", "2"]}
WINDOW = 20  # requests of the new domain at the start and at the end


def summarize(args) -> dict:
    from onlinespec.stream import pooled_alpha

    out = {"machine": harness.machine(), "demo": ["onlinespec", "demo", "--per-domain", args.per_domain], "runs": {}}
    for label in RUNS:
        result = json.loads((args.work / _slug(label) / "online.json").read_text())
        rows = [r for r in result["requests"] if "error" not in r]
        new = [r for r in rows if r["domain"] == args.new_domain]
        c = result.get("comparison", {})
        out["runs"][label] = {
            "requests": len(rows), "errors": result["summary"]["n_errors"],
            "identical_to_target_alone": [c.get("identical"), c.get("n_requests")],
            "tokens_per_s": result["summary"]["tokens_per_s"],
            f"{args.new_domain}_alpha_first_{WINDOW}": pooled_alpha(new[:WINDOW]),
            f"{args.new_domain}_alpha_last_{WINDOW}": pooled_alpha(new[-WINDOW:]),
            "online/static_while_serving": c.get("tokens_per_s", {}).get("online", 0) / max(1e-9, c.get("tokens_per_s", {}).get("static", 0)),
            "updates": [(u["draft"], u["version"], u["outcome"]) for u in result["updates"]],
            "accepted_judged": [(r["accepted"], r["judged"]) for r in new],
        }
    return out


def _slug(label: str) -> str:
    return "single" if label == "one process" else "ray-2"


def plot(summary: dict, path: Path, domain: str) -> None:
    fig, ax = harness.figure(figsize=(7, 3.6))
    for label, run in summary["runs"].items():
        pairs = run["accepted_judged"]
        windows = [pairs[max(0, i - 9):i + 1] for i in range(len(pairs))]  # accepted over judged, the last 10 requests
        ax.plot([sum(a for a, _ in w) / max(1, sum(j for _, j in w)) for w in windows], label=f"{label} (identical {run['identical_to_target_alone'][0]}/"
                                                        f"{run['identical_to_target_alone'][1]})")
    ax.set_xlabel(f"{domain} request (stream order)")
    ax.set_ylabel("alpha over the last 10 requests (pooled)")
    ax.set_title(f"The demo's new domain ({domain}) while its draft learns", fontsize=9)
    ax.legend(fontsize=8)
    harness.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-domain", default="80,20,20")
    parser.add_argument("--new-domain", default="math_ml")
    parser.add_argument("--work", type=Path, default=harness.RUNS / "ray-demo")
    parser.add_argument("--out", type=Path, default=DOCS / "ray-demo")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if not args.report_only:
        for label, extra in RUNS.items():
            command = [sys.executable, "-m", "onlinespec.cli", "demo", "--per-domain", args.per_domain,
                       "--out-dir", str(args.work / _slug(label)), *extra]
            print(f"[{label}] {' '.join(command[2:])}", flush=True)
            subprocess.run(command, check=True)
    summary = summarize(args)
    harness.write_result(args.out.with_suffix(".json"), summary)
    plot(summary, args.out.with_suffix(".png"), args.new_domain)
    for label, run in summary["runs"].items():
        print(f"{label}: identical {run['identical_to_target_alone']}, {args.new_domain} alpha first {WINDOW} "
              f"{run[f'{args.new_domain}_alpha_first_{WINDOW}']:.3f} -> last {WINDOW} {run[f'{args.new_domain}_alpha_last_{WINDOW}']:.3f}, "
              f"{run['tokens_per_s']:.1f} tok/s per request, online/static {run['online/static_while_serving']:.3f}x, "
              f"{sum(u[2] == 'published' for u in run['updates'])} published, errors {run['errors']}")


if __name__ == "__main__":
    main()
