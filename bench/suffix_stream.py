"""A stream from a domain the packaged draft never saw, served several ways over the same requests:
what the suffix index and the head's online updates each add (docs/online-demo.md).

One run of this script serves the same ``--n`` online-split requests of ``--domain``, one at a
time (the per-request view), through the serving core in this process:

1. ``static``: the default draft kept static (n-gram lookup + the packaged head, no index);
2. ``suffix``: the suffix index learning from every request, the head kept static (``--no-head-updates``);
3. ``online``: both learning (the suffix index and the head's updates every ``--interval`` requests);
   ``online-idle``: the same with the learner thread at SCHED_IDLE rather than nice 19;
4. ``target``: the target alone (the reference every greedy output must equal);
5. then the last ``--last`` requests again: by what ``online`` learned (its final head and its
   index, less those requests) with the learner idle, recording on (``paused``) and off
   (``paused-norecord``), and by the static draft again (``static-again``: the machine's drift).

It reports tokens/s over the last ``--last`` requests of each against ``static`` on the same
requests (pooled tokens over pooled seconds, with a paired bootstrap 95% interval over requests),
alpha, how many proposals each drafter made and how many the target kept, and writes a PNG::

    python bench/suffix_stream.py --domain math_ml --n 300 --out docs/results/suffix-stream
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
from onlinespec.data.streams import abrupt_shifts
from onlinespec.metrics import bootstrap_ratio, moving_average
from onlinespec.online.learner import LearnerConfig
from onlinespec.serve.config import CoreConfig
from onlinespec.stream import OnlineConfig, run_stream
from onlinespec.stream import pooled_alpha as alpha

WORK = harness.RUNS / "suffix-stream"


def configs(interval: int) -> dict[str, CoreConfig]:
    learner = LearnerConfig(update_interval=interval)
    return {
        "static": CoreConfig(learn=False),
        "suffix": CoreConfig(learn=True, head_updates=False, router="single"),
        "online": CoreConfig(learn=True, router="single", learner=learner),
        # the same, the learner thread at SCHED_IDLE instead of nice 19 (LearnerConfig.priority)
        "online-idle": CoreConfig(learn=True, router="single", learner=dataclasses.replace(learner, priority="idle")),
        "target": CoreConfig(draft="none", learn=False),
    }


# The last ``--last`` requests served again, after the stream (each in a process of its own):
AGAIN = {
    # what ``online`` learned (its final head version and its suffix index, less these requests),
    # the learner idle but the recorder on (a learning server records every request)
    "paused": "online's final draft, learner idle, recording on",
    # the same draft served with nothing recorded (the head exported to a folder, the index kept)
    "paused-norecord": "online's final draft, nothing recorded",
    # the static draft again, right after: the machine's drift since the first pass
    "static-again": "the static draft again",
}
HEAD_COPY = WORK / "online-final-head"


def export_head() -> None:
    """``online``'s final head version as a head folder (what ``--draft hybrid:FOLDER`` serves)."""
    from onlinespec.decoding.feature_head import FeatureHead
    from onlinespec.factory import DEFAULT_HEAD, load_head
    from onlinespec.models import load_model
    from onlinespec.online.registry import DraftRegistry
    from onlinespec.weights import load_weights

    head = load_head(DEFAULT_HEAD, load_model("default"))
    [registry] = (WORK / "online" / "drafts").iterdir()
    load_weights(head, DraftRegistry(registry).load(), str(registry))
    head.save(HEAD_COPY, {**FeatureHead.info(DEFAULT_HEAD), "learned_online": str(registry / DraftRegistry(registry).current())})


def serve_last_again(queries, args, mode: str) -> None:
    from onlinespec.decoding.proposers.suffix import SuffixIndex
    from onlinespec.decoding.proposers.suffix_files import SUFFIX_FILE

    out_dir, saved = WORK / mode, WORK / f"{mode}.json"
    shutil.rmtree(out_dir, ignore_errors=True)
    last = queries[len(queries) - args.last:]
    if mode == "static-again":
        core = CoreConfig(learn=False)
    else:
        shutil.copytree(WORK / "online", out_dir, ignore=shutil.ignore_patterns("LOCK", "events.jsonl", "buffer"))
        for path in out_dir.glob(f"drafts/*/{SUFFIX_FILE}"):
            index = SuffixIndex()
            index.load(path)
            for q in last:  # they would be drafted from their own answers
                index.purge(request_id=q.id)
            index.save(path)
        if mode == "paused":
            core = CoreConfig(learn=True, router="single", learner=LearnerConfig(update_interval=10**9))
        else:
            core = CoreConfig(draft=f"hybrid:{HEAD_COPY}", learn=True, head_updates=False, router="single")
    result = run_stream(last, OnlineConfig(core, args.max_new_tokens, 1, 0), out_dir,
                        on_status=lambda text: print(f"[{mode}] {text}", flush=True))
    saved.write_text(json.dumps(result))


def pooled(rows: list[dict]) -> float:
    return sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)


def drafters(rows: list[dict]) -> dict[str, dict]:
    out: dict[str, list[int]] = {}
    for r in rows:
        for name, tally in r.get("by_drafter", r.get("by_source", {})).items():  # by_source: rows saved before the rename
            both = out.setdefault(name, [0, 0])
            both[0] += tally["draft_tokens"]
            both[1] += tally["accepted_tokens"]
    return {name: {"draft_tokens": sent, "accepted_tokens": kept, "kept": kept / sent if sent else 0.0} for name, (sent, kept) in sorted(out.items())}


def plot(results: dict, path: Path, title: str, window: int = 25) -> None:
    fig, (top, bottom) = harness.figure(2, 1, figsize=(10, 7), sharex=True)
    harness.lines(top, {name: moving_average([r["tokens_per_s"] for r in rows], window) for name, rows in results.items()},
                  title=title, ylabel=f"tokens/s per request ({window}-request moving average)")
    harness.lines(bottom, {name: moving_average([r["acceptance_rate"] for r in rows], window) for name, rows in results.items() if name != "target"},
                  xlabel="request", ylabel=f"alpha ({window}-request moving average)")
    harness.save(fig, path, dpi=110)


def run_one(args, queries, name: str) -> None:
    """One configuration served in this process (a serving core per process: a second engine
    thread's OpenMP team would slow the first's forwards 1.6x)."""
    core = configs(args.interval)[name]
    out_dir, saved = WORK / name, WORK / f"{name}.json"
    shutil.rmtree(out_dir, ignore_errors=True)
    began = time.time()
    result = run_stream(queries, OnlineConfig(core, args.max_new_tokens, 1, 0), out_dir, on_status=lambda text: print(f"[{name}] {text}", flush=True))
    result["wall_seconds"] = time.time() - began
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(result))


def passed_args(args) -> list[str]:
    """This command's arguments less --only, for the child runs."""
    return [a for a in sys.argv[1:] if not a.startswith("--only") and a not in (args.only or "",)]


def collect(args) -> tuple[dict, dict]:
    """Each configuration's rows (run now in a child process if --only names it), and its result."""
    results, summaries = {}, {}
    for name in configs(args.interval):
        saved = WORK / f"{name}.json"
        if not args.only or name in args.only.split(","):
            subprocess.run([sys.executable, __file__, *passed_args(args), "--run", name], check=True)
        if not saved.exists():
            print(f"{name}: not run yet (run it with --only {name})")
            continue
        result = json.loads(saved.read_text())
        rows = sorted(result["requests"], key=lambda r: r["i"])
        if any("error" in r for r in rows):
            raise SystemExit(f"{name}: {sum('error' in r for r in rows)} requests failed; see {saved}")
        results[name], summaries[name] = rows, result
        print(f"{name}: {pooled(rows):.1f} tok/s, alpha {alpha(rows):.3f} ({result.get('wall_seconds', 0):.0f} s)", flush=True)
    return results, summaries


def compare(args, results: dict, summaries: dict, table: list[str], figures: dict) -> None:
    """Each configuration's row against ``static`` and the target alone over the last ``--last``."""
    static, target = results["static"], results["target"]
    cut = len(static) - args.last
    for name, rows in results.items():
        identical = sum(a.get("text_sha256") == b.get("text_sha256") for a, b in zip(rows, target))
        last, last_static = rows[cut:], static[cut:]
        samples = [(a["new_tokens"], a["seconds"], b["new_tokens"], b["seconds"]) for a, b in zip(last, last_static)]
        ratio = pooled(last) / pooled(last_static)
        low, high = bootstrap_ratio(samples) if name != "static" else (1.0, 1.0)
        vs_target = pooled(last) / pooled(target[cut:])
        updates = summaries[name].get("updates", [])
        figures[name] = {"tokens_per_s_all": pooled(rows), "tokens_per_s_last": pooled(last), "alpha_all": alpha(rows),
                         "alpha_first": alpha(rows[: args.last]), "alpha_last": alpha(last), "last_vs_static": ratio,
                         "last_vs_static_95ci": [low, high], "last_vs_target": vs_target, "identical": identical,
                         "drafters_last": drafters(last), "updates": len(updates),
                         "published": sum(1 for u in updates if u.get("outcome") == "published")}
        kept = ", ".join(f"{s} {v['accepted_tokens']}/{v['draft_tokens']}" for s, v in figures[name]["drafters_last"].items()) or "-"
        table.append(f"| {name} | {pooled(rows):.1f} | {pooled(last):.1f} | {ratio:.3f}x ({low:.3f}-{high:.3f}) | {vs_target:.2f}x | "
                     f"{alpha(rows[: args.last]):.3f} -> {alpha(last):.3f} | {kept} | "
                     f"{figures[name]['published']}/{figures[name]['updates']} | {identical}/{len(rows)} |")


def compare_again(args, results: dict, table: list[str], figures: dict) -> None:
    """The last ``--last`` requests served again by what ``online`` learned (AGAIN), run if missing."""
    static, target = results["static"], results["target"]
    cut = len(static) - args.last
    for mode, label in AGAIN.items():
        again_file = WORK / f"{mode}.json"
        if (args.only and mode in args.only.split(",")) or ("online" in (args.only or "").split(",")) or not again_file.exists():
            if mode == "paused-norecord":
                subprocess.run([sys.executable, __file__, *passed_args(args), "--run", "export-head"], check=True)
            subprocess.run([sys.executable, __file__, *passed_args(args), "--run", mode], check=True)
        again = sorted(json.loads(again_file.read_text())["requests"], key=lambda r: r["i"])
        samples = [(a["new_tokens"], a["seconds"], b["new_tokens"], b["seconds"]) for a, b in zip(again, static[cut:])]
        low, high = bootstrap_ratio(samples)
        ratio = pooled(again) / pooled(static[cut:])
        identical = sum(a.get("text_sha256") == b.get("text_sha256") for a, b in zip(again, target[cut:]))
        figures[mode] = {"tokens_per_s_last": pooled(again), "alpha_last": alpha(again), "last_vs_static": ratio,
                         "last_vs_static_95ci": [low, high], "last_vs_target": pooled(again) / pooled(target[cut:]),
                         "identical": identical, "drafters_last": drafters(again)}
        kept = ", ".join(f"{s} {v['accepted_tokens']}/{v['draft_tokens']}" for s, v in drafters(again).items()) or "-"
        table.append(f"| {label} (the last {args.last} again) | - | {pooled(again):.1f} | {ratio:.3f}x ({low:.3f}-{high:.3f}) | "
                     f"{pooled(again) / pooled(target[cut:]):.2f}x | - -> {alpha(again):.3f} | {kept} | - | {identical}/{len(again)} |")


def write(args, results: dict, table: list[str], figures: dict) -> None:
    plot(results, args.out.with_suffix(".png"), f"{args.n} {args.domain} requests (online split), one at a time, {args.max_new_tokens} new tokens")
    command = ["python", "bench/suffix_stream.py", "--domain", args.domain, "--n", str(args.n), "--last", str(args.last), "--interval", str(args.interval)]
    machine = harness.machine()
    header = [
        (f"Command: `{shlex.join(command)}`. Machine: {machine['platform']}, {machine['cpu_model']}, {machine['torch_threads']} torch threads. "
        f"Date: {machine['date']}."), "",
        (f"| configuration | tok/s, all {args.n} | tok/s, last {args.last} | last {args.last} / static (95% interval) | "
        f"last {args.last} / target alone | alpha first {args.last} -> last {args.last} | proposals kept/sent, last {args.last} | "
        "updates published | identical to target alone |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    args.out.with_suffix(".md").write_text("\n".join(header + table) + "\n")
    harness.write_result(args.out.with_suffix(".json"), {"machine": machine, "figures": figures}, command=command)
    print("\n".join(header + table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", default="math_ml")
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--last", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--interval", type=int, default=10, help="I: the head's update interval (requests)")
    parser.add_argument("--only", default=None, help="comma-separated configurations to (re)run; the others are read from WORK")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one configuration, in this process
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "suffix-stream")
    args = parser.parse_args()
    pool = split_queries(stream_pools([args.domain])[args.domain], "online")
    queries = abrupt_shifts({args.domain: pool}, args.n, seed=0)
    if args.run in AGAIN:
        serve_last_again(queries, args, args.run)
    elif args.run == "export-head":
        export_head()
    elif args.run:
        run_one(args, queries, args.run)
    else:
        results, summaries = collect(args)
        if set(results) != set(configs(args.interval)):
            return
        table, figures = [], {}
        compare(args, results, summaries, table, figures)
        compare_again(args, results, table, figures)
        write(args, results, table, figures)


if __name__ == "__main__":
    main()
