"""Cold start: a draft that learns the target from nothing, beside the packaged head, under open-loop load.

The default target (on the backend that serves by default), three servers one after the other,
each fed the same trace of held-out requests (chat, code and maths in turn) arriving as a Poisson
process, open loop as vLLM's serving benchmark does with ``--request-rate``, at ``--load`` times the
target alone's measured capacity (requests per second at ``--max-batch`` in flight, greedy):

- ``fresh``: ``--draft hybrid:fresh``, n-gram lookup + suffix index + a head born from the
  target (its vocabulary from the served text), learning from the first request;
- ``packaged``: ``--draft hybrid``, the same with the packaged head (trained offline), learning;
- ``suffix``: ``--draft suffix``, n-gram lookup + suffix index only (learning: the index).

Every request is greedy and streamed through the real ``openai`` client on 127.0.0.1; the server's
event log gives each request's acceptance (alpha), tokens per target forward (tau) and timings.
Reported by block of ``--block`` requests. Acceptance and tau do not depend on the machine's
speed; TTFT and TPOT do, and the servers run one after the other (not interleaved): read them
as indicative on this machine, whose speed drifts 2-3x within an hour.

    python bench/cold_start.py --n 200                 # ~30 min on 2 cores
    python bench/cold_start.py --report-only           # rewrite docs/cold-start.png from the JSON

Writes docs/cold-start.json and docs/cold-start.png; docs/online-learning.md quotes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "bench"))

CONFIGS = {"fresh": ["--draft", "hybrid:fresh"], "packaged": ["--draft", "hybrid"], "suffix": ["--draft", "suffix"]}


def capacity(args, queries, out: Path) -> float:
    """The target alone's requests per second at ``--max-batch`` in flight (closed loop)."""
    import openai

    from onlinespec.serve.server import ServerProcess
    from serve_load import run_level

    with ServerProcess(["--draft", "none", "--out-dir", str(out / "alone"), "--max-batch", str(args.max_batch)],
                       log=out / "alone.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        level = run_level(client, model, queries, args.max_tokens, args.max_batch)
    print(f"target alone: {level['requests_per_s']:.3f} requests/s, {level['tokens_per_s']:.1f} tokens/s at {args.max_batch} in flight",
          flush=True)
    return level["requests_per_s"]


def open_loop(name: str, args, queries, arrivals: list[float], out: Path) -> list[dict]:
    """Serve ``queries`` arriving at ``arrivals`` (seconds from the start); each request's figures."""
    import openai

    from onlinespec.serve.server import ServerProcess
    from serve_load import send

    shutil.rmtree(out / name, ignore_errors=True)  # every run starts from nothing learnt
    server_args = [*CONFIGS[name], "--out-dir", str(out / name), "--max-batch", str(args.max_batch), "--max-waiting", "512",
                   *args.server_args]
    sent: dict[str, dict] = {}
    with ServerProcess(server_args, log=out / f"{name}.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=1800)
        model = client.models.list().data[0].id
        start = time.perf_counter()
        threads = []

        def one(i: int) -> None:
            q = queries[i]
            sent[q.id] = {"i": i, **send(client, model, q, args.max_tokens, headers={"X-Request-Id": f"cold-{i}"})}

        for i, at in enumerate(arrivals):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            thread = threading.Thread(target=one, args=(i,), daemon=True)
            thread.start()
            threads.append(thread)
            if i % args.block == args.block - 1:
                print(f"[{name}] {i + 1}/{len(arrivals)} sent, {len(sent)} answered, {time.perf_counter() - start:.0f} s", flush=True)
        for thread in threads:
            thread.join()
    logged = [json.loads(line) for line in (out / name / "events.jsonl").read_text().splitlines()]
    served = [e for e in logged if e["event"] == "request"]
    updates = [e for e in logged if e["event"] == "update"]
    control = [e for e in logged if e["event"] == "learn_control"]
    rows = []
    for q in queries:
        r = sent[q.id]
        rows.append({"i": r["i"], "id": q.id, "domain": q.domain, "error": r["error"], "tokens": r["tokens"],
                     "latency_s": r["latency_s"], "ttft_s": r["ttft_s"], "text": r["text"]})
    by_id = {e["id"]: e for e in served}  # the server's log has each request's speculation figures
    for row in rows:
        event = by_id.get(f"cold-{row['i']}")
        if event is not None:
            row.update(alpha=event["alpha"], tau=event["tau"], draft_version=event["draft_version"])
    print(f"[{name}] {len(updates)} updates ({sum(1 for u in updates if u.get('version'))} published), "
          f"{len(control)} controller decisions", flush=True)
    return sorted(rows, key=lambda r: r["i"]), updates, control


def blocks(rows: list[dict], size: int) -> list[dict]:
    from onlinespec.metrics import percentile

    out = []
    for b in range(0, len(rows), size):
        part = [r for r in rows[b: b + size] if r["error"] is None and r["tokens"] > 1]
        tpot = [(r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in part]
        out.append({"requests": f"{b + 1}-{b + len(rows[b: b + size])}", "alpha": sum(r.get("alpha", 0) for r in part) / max(1, len(part)),
                    "tau": sum(r.get("tau", 1) for r in part) / max(1, len(part)),
                    "tpot_p50_ms": 1000 * percentile(tpot, 50) if tpot else None,
                    "ttft_p50_s": percentile([r["ttft_s"] for r in part], 50) if part else None,
                    "errors": sum(r["error"] is not None for r in rows[b: b + size])})
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, run in summary["runs"].items():
        x = [int(b["requests"].split("-")[1]) for b in run["blocks"]]
        axes[0].plot(x, [b["alpha"] for b in run["blocks"]], marker="o", label=name)
        axes[1].plot(x, [b["tau"] for b in run["blocks"]], marker="o", label=name)
        axes[2].plot(x, [b["tpot_p50_ms"] for b in run["blocks"]], marker="o", label=name)
    axes[1].axhline(1.0, color="grey", ls=":", label="target alone")
    axes[0].set(title="acceptance (alpha) by block", xlabel="requests served", ylabel="alpha")
    axes[1].set(title="tokens per target forward (tau)", xlabel="requests served")
    axes[2].set(title="TPOT p50 (indicative: runs one after the other)", xlabel="requests served", ylabel="ms")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"cold start at {summary['load']:.0%} of target-alone capacity ({summary['machine']['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--load", type=float, default=0.6, help="arrival rate, as a fraction of the target alone's capacity")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--configs", default="fresh,packaged,suffix")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `onlinespec serve` flags for every server")
    parser.add_argument("--out", default="runs/cold-start")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--merge", action="store_true", help="replace only --configs' runs in the JSON (the same trace: same --n and capacity)")
    args = parser.parse_args()
    path = DOCS / "cold-start.json"
    if args.report_only:
        summary = json.loads(path.read_text())
    else:
        from onlinespec.benchmark import machine_info
        from serve_load import held_out

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        queries = held_out(args.n)
        previous = json.loads(path.read_text()) if args.merge and path.exists() else None
        rate = previous["rate_per_s"] if previous else args.load * capacity(args, queries[: 3 * args.max_batch], out)
        rng = random.Random(0)
        arrivals, t = [], 0.0
        for _ in queries:
            t += rng.expovariate(rate)
            arrivals.append(t)
        runs = dict(previous["runs"]) if previous else {}
        for name in args.configs.split(","):
            rows, updates, control = open_loop(name, args, queries, arrivals, out)
            runs[name] = {"blocks": blocks(rows, args.block), "updates": len(updates),
                          "published": sum(1 for u in updates if u.get("version")), "controller": control[-20:],
                          "texts": {r["id"]: r["text"] for r in rows}}
        texts = {name: run.pop("texts") for name, run in runs.items() if "texts" in run}
        digests = {n: {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in t.items()} for n, t in texts.items()}
        for name, run in runs.items():
            run["text_sha256"] = digests.get(name, run.get("text_sha256", {}))
        first = next(iter(runs.values()))["text_sha256"]
        for run in runs.values():
            run["identical_to_first"] = sum(run["text_sha256"].get(k) == first[k] for k in first)
        summary = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "n": args.n, "load": args.load,
                   "rate_per_s": rate, "max_tokens": args.max_tokens, "server_args": args.server_args, "runs": runs}
        path.write_text(json.dumps(summary, indent=1))
    plot(summary, DOCS / "cold-start.png")
    print(json.dumps({name: run["blocks"] for name, run in summary["runs"].items()}, indent=1))


if __name__ == "__main__":
    main()
