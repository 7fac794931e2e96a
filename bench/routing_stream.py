"""Content routing against oracle labels and one shared draft, on a stream whose domains come back
(docs/routing.md).

The stream: ``--segment`` online-split requests of each of code, maths in 23 languages, chat,
code again, maths again (no request served twice). Served in a process of its
own (six runs), ``--concurrency`` requests in flight, the drafts learning every ``--interval`` requests:

1. ``content``: the labels removed; the content router clusters the prompts and routes;
2. ``oracle``: the true labels, one draft per domain (``--router domain``);
3. ``single``: one shared draft learning everything;
4. ``static``: the packaged draft, nothing learnt (the throughput reference);
5. ``target``: the target alone, on every ``--target-every``-th request (greedy outputs must equal);
6. ``stationary``: ``--stationary`` chat requests with the labels removed, for false alarms.

It reports alpha over the stream and on the returning segments, when each shift was detected,
the returning domains' alpha against the end of their previous segment, tokens/s against static
with a paired bootstrap 95% interval, identity with the target alone, and writes the routing
report's PNG of the content run::

    python bench/routing_stream.py --segment 150 --out docs/results/routing-stream
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from onlinespec.data.sources import stream_pools
from onlinespec.data.splits import split as split_queries
from onlinespec.data.streams import segments
from onlinespec.metrics import bootstrap_ratio
from onlinespec.online.learner import LearnerConfig
from onlinespec.online.report import routing_report
from onlinespec.serve.config import CoreConfig
from onlinespec.stream import OnlineConfig, pooled_alpha, run_stream

WORK = harness.RUNS / "routing-stream"
ORDER = ("code", "math_ml", "chat", "code", "math_ml")
RUNS = ("content", "oracle", "single", "static", "target", "stationary")
DETECTIONS = ("drift", "cluster_returned")  # router events that mark a change it noticed


def core(name: str, interval: int, max_drafts: int) -> CoreConfig:
    learner = LearnerConfig(update_interval=interval)
    return {
        "content": CoreConfig(router="content", max_drafts=max_drafts, learner=learner),
        "stationary": CoreConfig(router="content", max_drafts=max_drafts, learner=learner),
        "oracle": CoreConfig(router="domain", learner=learner),
        "single": CoreConfig(router="single", learner=learner),
        "static": CoreConfig(learn=False),
        "target": CoreConfig(draft="none", learn=False),
    }[name]


def stream(args, name: str):
    pools = {d: split_queries(p, "online") for d, p in stream_pools(sorted(set(ORDER))).items()}
    if name == "stationary":
        queries = segments(pools, [("chat", args.stationary)], seed=1)
    else:
        queries = segments(pools, [(d, args.segment) for d in ORDER], seed=0)
    if name in ("content", "stationary"):  # no labels: the router sees the prompts only
        queries = [dataclasses.replace(q, domain="default") for q in queries]
    if name == "target":
        queries = queries[:: args.target_every]
    return queries


def run_one(args, name: str) -> None:
    out_dir, saved = WORK / name, WORK / f"{name}.json"
    shutil.rmtree(out_dir, ignore_errors=True)
    tokens = args.stationary_tokens if name == "stationary" else args.max_new_tokens
    began = time.time()
    result = run_stream(stream(args, name), OnlineConfig(core(name, args.interval, args.max_drafts), tokens, args.concurrency, 0),
                        out_dir, on_status=lambda text: print(f"[{name}] {text}", flush=True))
    result["wall_seconds"] = time.time() - began
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(result))


def events(name: str) -> list[dict]:
    path = WORK / name / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pooled(rows) -> float:
    return sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)


def collect(args) -> dict:
    """Each run's rows, run now in a child process if --only names it."""
    passed = [a for a in sys.argv[1:] if not a.startswith("--only") and a != args.only]
    results = {}
    for name in RUNS:
        if not args.only or name in args.only.split(","):
            subprocess.run([sys.executable, __file__, *passed, "--run", name], check=True)
        saved = WORK / f"{name}.json"
        if not saved.exists():
            raise SystemExit(f"{name}: not run yet (run it with --only {name})")
        results[name] = sorted(json.loads(saved.read_text())["requests"], key=lambda r: r["i"])
        failed = [r for r in results[name] if "error" in r]
        if failed:
            raise SystemExit(f"{name}: {len(failed)} requests failed, the first: {failed[0]['error']}")
    return results


def shifts(args, results: dict, figures: dict) -> None:
    """Alpha on the returning segments, when each shift was detected, false alarms, and alpha at each return."""
    n, w = args.segment, args.window
    bounds = [i * n for i in range(len(ORDER))]
    returning = [i for i, d in enumerate(ORDER) if d in ORDER[:i]]
    back = {m: pooled_alpha([r for s in returning for r in results[m][bounds[s]: bounds[s] + n]]) for m in ("content", "oracle", "single")}
    figures["returning_alpha"] = back
    figures["returning_content_minus_single"] = back["content"] - back["single"]
    detections = [e for e in events("content") if e["event"] in DETECTIONS]
    latency = {}
    for s in range(1, len(ORDER)):
        after = [e["routed"] - bounds[s] for e in detections if bounds[s] < e["routed"] <= bounds[s] + n]
        latency[f"{ORDER[s - 1]} -> {ORDER[s]} (request {bounds[s]})"] = min(after) if after else None
    figures["detection_latency"] = latency
    inside = [e for e in detections if not any(0 < e["routed"] - b <= w for b in bounds[1:])]
    figures["detections_outside_shifts"] = len(inside)
    stationary = [e for e in events("stationary") if e["event"] in DETECTIONS]
    figures["stationary"] = {"requests": len(results["stationary"]), "detections": len(stationary),
                             "per_500": len(stationary) * 500 / len(results["stationary"]), "events": stationary}
    ret = {}
    for s in returning:
        previous = max(i for i in range(s) if ORDER[i] == ORDER[s])
        end = pooled_alpha(results["content"][bounds[previous] + n - w: bounds[previous] + n])
        start = pooled_alpha(results["content"][bounds[s]: bounds[s] + w])
        ret[f"{ORDER[s]} (request {bounds[s]})"] = {"end_of_previous": end, "first_of_return": start, "difference": start - end}
    figures["return"] = ret


def speed(args, results: dict, figures: dict) -> None:
    """Tokens/s against the static draft, greedy identity against the target alone, drafts made."""
    content, static = results["content"], results["static"]
    samples = [(a["new_tokens"], a["seconds"], b["new_tokens"], b["seconds"]) for a, b in zip(content, static)]
    figures["tokens_per_s"] = {m: pooled(results[m]) for m in ("content", "oracle", "single", "static")}
    figures["content_vs_static"] = pooled(content) / pooled(static)
    figures["content_vs_static_95ci"] = list(bootstrap_ratio(samples))
    target = {r["i"] * args.target_every: r for r in results["target"]}
    figures["identical_to_target"] = {m: [sum(results[m][i]["text_sha256"] == t["text_sha256"] for i, t in target.items()), len(target)]
                                      for m in ("content", "oracle", "single", "static")}
    figures["drafts"] = {m: sorted({r["draft"] for r in results[m]}) for m in ("content", "oracle", "single")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segment", type=int, default=150)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--interval", type=int, default=25)
    parser.add_argument("--max-drafts", type=int, default=4)
    parser.add_argument("--target-every", type=int, default=5)
    parser.add_argument("--stationary", type=int, default=500)
    parser.add_argument("--stationary-tokens", type=int, default=8)
    parser.add_argument("--window", type=int, default=30)
    parser.add_argument("--only", default=None, help="comma-separated runs to (re)run; the others are read from WORK (none: report only)")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "routing-stream")
    args = parser.parse_args()
    if args.run:
        run_one(args, args.run)
        return
    results = collect(args)
    figures: dict = {"alpha": {m: pooled_alpha(results[m]) for m in ("content", "oracle", "single", "static")}}
    figures["content_vs_oracle"] = figures["alpha"]["content"] / figures["alpha"]["oracle"]
    shifts(args, results, figures)
    speed(args, results, figures)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    routing_report(WORK / "content", args.out.with_suffix(".png"), segments=[(i * args.segment, d) for i, d in enumerate(ORDER)])
    command = ["python", "bench/routing_stream.py", "--segment", str(args.segment), "--max-new-tokens", str(args.max_new_tokens),
               "--concurrency", str(args.concurrency), "--interval", str(args.interval), "--max-drafts", str(args.max_drafts),
               "--stationary", str(args.stationary), "--stationary-tokens", str(args.stationary_tokens)]
    machine = harness.machine()
    lines = [(f"Command: `{shlex.join(command)}`. Machine: {machine['platform']}, {machine['cpu_model']}, {machine['torch_threads']} torch threads. "
             f"Date: {machine['date']}."), "", "```json", json.dumps(figures, indent=1), "```"]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    harness.write_result(args.out.with_suffix(".json"), {"machine": machine, "figures": figures}, command=command)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
