"""A bounded load test of `onlinespec serve` from the real `openai` client on 127.0.0.1.

Two servers, one after the other, on the same machine: the default draft (kept static, so every
level sees the same draft) and `--draft none` (the target alone, the same engine and batching).
Each gets the same held-out requests at each concurrency level, streamed, greedy; the client
measures latency, time to first token and throughput, and checks that both servers' outputs are
identical token for token (by text) at every level.

    python bench/serve_load.py                       # 200 requests at 1, 4 and 8 in flight (~35 min here)
    python bench/serve_load.py --report-only         # rewrite docs/results/serve-load.png from the JSON

Writes docs/results/serve-load.json and docs/results/serve-load.png; docs/serve.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

DOCS = harness.RESULTS
DOMAINS = ("chat", "code", "math_ml")
SERVERS = {"speculative": ["--static"], "target_alone": ["--draft", "none"]}


def send(client, model: str, query, max_tokens: int, extra: dict | None = None, headers: dict | None = None) -> dict:
    """One streamed, greedy request timed by :func:`harness.stream_chat` (``extra``: more body
    fields; ``headers``: more headers); an error is counted in the row, never hidden."""
    body = {"domain": query.domain, **(extra or {})}
    started = time.perf_counter()
    try:
        if query.messages:
            timing = harness.stream_chat(client, list(query.messages), max_tokens, model, extra_headers=headers, **body)
        else:
            timing = harness.stream_completion(client, query.prompt, max_tokens, model, extra_headers=headers, **body)
    except Exception as err:  # noqa: BLE001 (counted, never hidden)
        end = time.perf_counter()
        return {"id": query.id, "text": "", "latency_s": end - started, "ttft_s": end - started, "tokens": 0,
                "error": f"{type(err).__name__}: {err}", "start": started, "end": end}
    return {"id": query.id, "text": timing["text"], "latency_s": timing["total_s"], "ttft_s": timing["ttft_s"], "tpot_s": timing["tpot_s"],
            "tokens": timing["completion_tokens"], "tokens_from": timing["tokens_from"], "error": None,
            "start": timing["start"], "end": timing["end"]}


def run_level(client, model: str, queries, max_tokens: int, concurrency: int, extra: dict | None = None) -> dict:
    from onlinespec.metrics import percentile

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda q: send(client, model, q, max_tokens, extra), queries))
    wall = time.perf_counter() - started
    ok = [r for r in results if r["error"] is None]
    latencies, ttfts = [r["latency_s"] for r in ok], [r["ttft_s"] for r in ok]
    return {
        "requests": len(results), "errors": len(results) - len(ok), "error_examples": [r["error"] for r in results if r["error"]][:3],
        "wall_s": wall, "tokens": sum(r["tokens"] for r in ok), "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "requests_per_s": len(ok) / wall,
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "texts": {r["id"]: r["text"] for r in results},
    }


def serve_levels(name: str, args, queries, out: Path) -> dict:
    server_args = [*SERVERS[name], "--out-dir", str(out / name), "--max-batch", str(max(args.levels)),
                   "--max-waiting", str(len(queries)), "--default-max-tokens", str(args.max_tokens)]
    print(f"[{name}] starting onlinespec serve {' '.join(server_args)}", flush=True)
    with harness.serve_onlinespec(server_args, log_path=out / f"{name}.log") as url:
        levels = measure_levels(name, harness.client(url, 600), queries, args.levels, args.max_tokens)
        metrics = __import__("httpx").get(url + "/metrics").text
    return {"levels": levels, "metrics_tail": [line for line in metrics.splitlines() if "spec_decode_num" in line and "_total" in line][:12]}


def measure_levels(name: str, client, queries, levels: list[int], max_tokens: int, extra: dict | None = None, warm: int = 4) -> dict:
    """Every query at each level of requests in flight (after ``warm`` requests not measured)."""
    model = client.models.list().data[0].id
    for q in queries[:warm]:
        send(client, model, q, 8, extra)
    figures = {}
    for n in levels:
        figures[n] = f = run_level(client, model, queries, max_tokens, n, extra)
        print(f"[{name}] {n} in flight: {f['tokens_per_s']:.1f} tok/s, p50 {f['latency_p50_s']:.2f} s, p99 {f['latency_p99_s']:.2f} s, "
              f"TTFT p50 {f['ttft_p50_s']:.3f} s, errors {f['errors']}", flush=True)
    return figures


def summarize(runs: dict, args, queries) -> dict:
    summary = {"n_prompts": len(queries), "config": {"max_new_tokens": args.max_tokens, "levels": args.levels,
                                                     "speculative_server": SERVERS["speculative"], "baseline_server": SERVERS["target_alone"]},
               "concurrency": {}}
    for n in args.levels:
        spec, alone = runs["speculative"]["levels"][n], runs["target_alone"]["levels"][n]
        same = sum(spec["texts"][q.id] == alone["texts"][q.id] for q in queries)
        summary["concurrency"][str(n)] = {
            "speculative": {k: v for k, v in spec.items() if k != "texts"},
            "target_alone": {k: v for k, v in alone.items() if k != "texts"},
            "speedup_vs_target": spec["tokens_per_s"] / alone["tokens_per_s"],
            "latency_p50_ratio": spec["latency_p50_s"] / alone["latency_p50_s"],
            "identical_outputs": same,
        }
    levels = list(summary["concurrency"].values())
    summary["errors"] = sum(f[m]["errors"] for f in levels for m in ("speculative", "target_alone"))
    summary["identical_across_levels"] = all(
        runs[m]["levels"][n]["texts"] == runs[m]["levels"][args.levels[0]]["texts"] for m in runs for n in args.levels)
    summary["median_speedup"] = statistics.median(f["speedup_vs_target"] for f in levels)
    return summary


def held_out(n: int) -> list:
    """``n`` held-out requests (never used in warm-up), chat, code and maths in 23 languages in turn."""
    import random

    from onlinespec.data.sources import stream_pools
    from onlinespec.data.splits import split

    pools = {d: split(q, "heldout") for d, q in stream_pools(DOMAINS).items()}
    for d, pool in pools.items():
        random.Random(f"0:{d}").shuffle(pool)
    return [pools[DOMAINS[i % len(DOMAINS)]][i // len(DOMAINS)] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--work", type=Path, default=Path("runs/serve-load"))
    parser.add_argument("--out", type=Path, default=DOCS / "serve-load", help="writes OUT.json and OUT.png")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    args.levels = [int(n) for n in args.levels.split(",")]
    from onlinespec.benchmark import plot_concurrency

    path = args.out.with_suffix(".json")
    if not args.report_only:
        queries = held_out(args.n)
        args.work.mkdir(parents=True, exist_ok=True)
        runs = {name: serve_levels(name, args, queries, args.work) for name in SERVERS}
        summary = summarize(runs, args, queries)
        harness.write_result(path, summary)
        (args.work / "texts.json").write_text(json.dumps({m: {n: r["levels"][n]["texts"] for n in r["levels"]} for m, r in runs.items()}))
    summary = json.loads(path.read_text())
    plot_concurrency(summary, args.out.with_suffix(".png"))
    for n, f in summary["concurrency"].items():
        s, a = f["speculative"], f["target_alone"]
        print(f"{n} in flight: {s['tokens_per_s']:.1f} vs {a['tokens_per_s']:.1f} tok/s ({f['speedup_vs_target']:.2f}x), "
              f"p50 {s['latency_p50_s']:.2f}/{a['latency_p50_s']:.2f} s, p99 {s['latency_p99_s']:.2f}/{a['latency_p99_s']:.2f} s, "
              f"TTFT p50 {s['ttft_p50_s']:.3f}/{a['ttft_p50_s']:.3f} s; identical {f['identical_outputs']}/{summary['n_prompts']}; "
              f"errors {s['errors']}+{a['errors']}")


if __name__ == "__main__":
    main()
