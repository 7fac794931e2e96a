"""The online loop inside the server, measured: a domain-shift stream sent to `onlinespec serve`
through the `openai` client, several requests in flight, while the drafts learn.

    python bench/serve_online.py              # 50 chat then 300 maths-in-23-languages requests (~15 min here)
    python bench/serve_online.py --report-only
    python bench/serve_online.py --replicas 2 --priority normal  # two replicas on a local Ray cluster (docs/scale.md)

The server serves the packaged feature head alone (``--draft head``, k = 4 fixed, so that alpha is
measured on the same number of proposals throughout), one draft per domain; the maths draft
starts from a head that never saw maths in those languages. Every 5th request is also served
by the starting head kept static (draft "static"), and after the stream, learning paused, by the
static head and the target alone again: the static head's two passes are the serving throughput
with the learner running vs paused, on the same requests and draft, in one run.

Writes docs/results/serve-online.json, docs/results/serve-online.png (alpha over requests) and the run's report
under runs/serve-online/run/ (with ``--replicas N``: docs/results/serve-online-ray.{json,png}, runs/serve-online-ray/).
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

DOCS = harness.RESULTS
LEARNER = ["--update-interval", "25", "--steps-per-update", "40", "--batch-size", "64", "--lr", "1e-3", "--positions", "verified"]


def segment_rise(rows: list[dict], domain: str, window: int = 50) -> dict:
    """Online alpha over the domain's first and last ``window`` requests, and the rise."""
    part = [r for r in rows if r["domain"] == domain]
    first = sum(r["acceptance_rate"] for r in part[:window]) / min(window, len(part))
    last = sum(r["acceptance_rate"] for r in part[-window:]) / min(window, len(part))
    probes = [r for r in part if "static" in r]
    static = sum(r["static"]["acceptance_rate"] for r in probes) / max(1, len(probes))
    return {"requests": len(part), "first": first, "last": last, "rise": last - first, "static_probes": static}


def server_args(args, run: Path, key: str) -> list[str]:
    flags = ["--draft", "head", "--fixed-k", "-k", "4", "--out-dir", str(run), "--static-baseline", "--admin-key", key,
             "--max-batch", str(args.concurrency), "--default-max-tokens", str(args.max_tokens), *LEARNER]
    if args.replicas:
        flags += ["--replicas", str(args.replicas)]
    if args.priority:
        flags += ["--priority", args.priority]
    return flags


def measure(args, names: list[str], path: Path) -> None:
    """Serve the stream online, write the result JSON, the run's report and its alpha plot."""
    from onlinespec.data.sources import stream_pools
    from onlinespec.data.splits import split
    from onlinespec.data.streams import abrupt_shifts
    from onlinespec.online.report import write_report
    from onlinespec.stream import HTTPClient, OnlineConfig, drive

    blocks = dict(zip(names, (int(n) for n in args.per_domain.split(","))))
    queries = abrupt_shifts({d: split(q, "online") for d, q in stream_pools(names).items()}, blocks, seed=0)
    run = args.work / "run"
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    key = secrets.token_hex(8)
    flags = server_args(args, run, key)
    config = OnlineConfig(max_new_tokens=args.max_tokens, concurrency=args.concurrency, compare_every=args.compare_every)
    started = time.time()

    def progress(row: dict) -> None:
        if row["i"] % 25 == 0:
            print(f"{row['i']:4d} {row['domain']:8s} alpha(50) {row['alpha_moving_average']:.3f} draft {row['draft']} "
                  f"{row['draft_version']} ({time.time() - started:.0f} s)", flush=True)

    print(f"onlinespec serve {' '.join(a if a != key else '***' for a in flags)}", flush=True)
    with harness.serve_onlinespec(flags, log_path=args.work / "server.log") as url:
        result = drive(queries, HTTPClient(url, admin_key=key), config, progress, lambda text: print(text, flush=True))
    # the server's log, and on Ray each learner actor's (learners/<group>/events.jsonl): where updates are logged
    events = [json.loads(line) for log in sorted(run.rglob("events.jsonl")) for line in log.read_text().splitlines()]
    served_at = sorted(r["time"] for r in result["requests"])  # when each stream request was answered
    published = [{"draft": e["draft"], "version": e["version"], "after_request": sum(t < e["time"] for t in served_at),
                  "seconds": e["seconds"]} for e in events if e["event"] == "update" and e["version"]]
    result.update(server_args=[a if a != key else "***" for a in flags], wall_seconds=time.time() - started,
                  published_while_serving=[p for p in published if p["after_request"] < len(queries)],
                  rise={d: segment_rise(result["requests"], d) for d in names})
    result = json.loads(harness.write_result(path, result).read_text())
    write_report({"online": result}, run, f"Served online: {' -> '.join(f'{blocks[d]} {d}' for d in names)}, "
                 f"head, {args.concurrency} in flight", result["command"])
    shutil.copy(run / "alpha.png", args.out.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domains", default="chat,math_ml")
    parser.add_argument("--per-domain", default="50,300")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--compare-every", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--replicas", type=int, default=0, help="serve with --replicas N on a local Ray cluster (0: one process)")
    parser.add_argument("--priority", default=None, help="the learner's priority (the server's default: low)")
    parser.add_argument("--work", type=Path, default=None, help="default: runs/serve-online (runs/serve-online-ray with --replicas)")
    parser.add_argument("--out", type=Path, default=None, help="default: docs/results/serve-online (docs/results/serve-online-ray with --replicas)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    name = "serve-online-ray" if args.replicas else "serve-online"
    args.work, args.out = args.work or harness.RUNS / name, args.out or DOCS / name
    path = args.out.with_suffix(".json")
    if not args.report_only:
        measure(args, args.domains.split(","), path)
    result = json.loads(path.read_text())
    c = result["comparison"]
    print(f"rise: {json.dumps(result['rise'], indent=1)}")
    print(f"published while serving: {len(result['published_while_serving'])} "
          f"({[(p['draft'], p['version'], p['after_request']) for p in result['published_while_serving']]})")
    print(f"learning on / off (static draft, same requests): {c['learning_on_vs_off']['static']:.3f} pooled, "
          f"{c['learning_on_vs_off']['static_median_ratio']:.3f} median; identical {c['identical']}/{c['n_requests']}")


if __name__ == "__main__":
    main()
