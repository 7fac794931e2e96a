"""Issue 46's memory soak: `onlinespec serve` with learning on, under bench/soak.py's mixed good
and hostile traffic, with a memory budget (``--memory-budget``), for 30 minutes. It passes if the
server's resident memory stays within 10% of its minute-5 value from minute 5 to the end, and the
budget's own count (/metrics ``onlinespec:memory_used_bytes``) stays under the budget throughout.

    python bench/soak_memory.py                          # 30 minutes, budget 1GiB (~35 min with start-up)
    python bench/soak_memory.py --minutes 1              # a quick check that it runs (no verdict: warm-up is 5 min)
    python bench/soak_memory.py --memory-budget 512MiB --in-flight 4

Writes docs/results/soak-memory.json and its plot (.png); docs/reliability.md, "Memory budget", quotes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # bench/harness.py: results with their command and machine
import soak  # bench/soak.py: the traffic, the sampler, the plot

TOLERANCE = 0.10  # resident memory from minute 5 on, against minute 5's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--memory-budget", default="1GiB", help="the server's --memory-budget")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--bad-share", type=float, default=0.3, help="share of requests that are hostile")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="runs/soak-memory")
    parser.add_argument("--json", default=str(soak.DOCS / "soak-memory.json"))
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `onlinespec serve` flags")
    args = parser.parse_args()
    args.server_args = ["--memory-budget", args.memory_budget, *args.server_args]  # learning is on by default
    summary = soak.soak(args)
    warmed = summary["minutes"] * 60 > soak.WARM_S + 60
    summary["memory_within_tolerance"] = summary["memory_max_deviation_after_warm"] <= TOLERANCE if warmed else None
    summary["passed"] = bool(warmed and summary["memory_within_tolerance"] and summary["memory_accounted_under_budget"])
    path = Path(args.json)
    harness.write_result(path, summary)  # with the command, the machine and the date (the plot's title reads it)
    summary = json.loads(path.read_text())
    soak.plot(summary, path.with_suffix(".png"))
    print(json.dumps({k: summary[k] for k in ("memory_max_deviation_after_warm", "memory_accounted_peak_bytes", "memory_budget_bytes",
                                             "memory_evictions", "memory_accounted_under_budget", "memory_within_tolerance", "passed")}, indent=1))
    if not warmed:
        print(f"shorter than warm-up ({soak.WARM_S / 60:.0f} min) plus a minute: no verdict on memory", flush=True)


if __name__ == "__main__":
    main()
