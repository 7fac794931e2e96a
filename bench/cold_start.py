"""Cold start: a draft that learns the target from nothing, beside the packaged head, under open-loop load.

The default target (on the backend that serves by default), one server per configuration, all
fed the same trace of online-split requests (chat, code and maths in turn) arriving as a Poisson
process, open loop as vLLM's serving benchmark does with ``--request-rate``, at ``--load`` times the
target alone's measured capacity (requests per second at ``--max-batch`` in flight, greedy):

- ``fresh``: ``--draft hybrid:fresh --router single``, n-gram lookup + suffix index + a head born
  from the target (its vocabulary from the served text), learning from the first request, one
  draft for every domain (a cold head learns faster from all the traffic than from a third of it:
  ``bench/fresh_head_data.py``); ``fresh-domain``: the same, one draft per domain;
- ``packaged``: ``--draft hybrid``, the same with the packaged head (trained offline), learning;
- ``suffix``: ``--draft suffix``, n-gram lookup + suffix index only (learning: the index);
- ``alone``: ``--draft none``, the target alone (nothing to learn: it serves every
  ``--alone-every``-th block only);
- ``static``: ``--draft hybrid --static``, the packaged hybrid learning nothing (suffix index
  included); ``index``: the same learning through its suffix index only (``--no-head-updates``).

Closed loop (``--in-flight N``: N requests in flight, no arrival trace) compares learning on and
off at full load, e.g. ``--in-flight 8 --configs packaged,index,static --domains chat``. A shift
(``--segments``): the domains one after another instead of in turn, e.g. ``--in-flight 1
--segments --domains chat,math_ml,code --configs packaged,static,alone``.

**Interleaved in blocks**, so that the machine's drift (2-3x within an hour here) falls on every
configuration alike: all servers start, then are paused (SIGSTOP); block after block of
``--block`` requests, each configuration in turn (the order rotating by block) is resumed, served
that block's arrivals (the same gaps), waited for, and paused again. A server's learning runs only
while it is resumed, in the engine's idle time and its ``--learn-share`` under load, as it would
in a run of its own; the pauses only stop its clock.

Every request is greedy and streamed through the real ``openai`` client on 127.0.0.1; the server's
event log gives each request's acceptance (alpha), tokens per target forward (tau) and timings.
Reported by block::

    python bench/cold_start.py --n 1000                # ~65 min on 2 cores
    python bench/cold_start.py --report-only           # rewrite docs/results/cold-start.png from the JSON
    # another architecture and tokenizer, with no packaged head (`make other-target` prints its path):
    python bench/cold_start.py --n 300 --configs fresh,suffix,alone --json docs/results/cold-start-gemma.json \
        --server-args --target GEMMA.gguf --chat-template bench/question-answer.jinja

Writes docs/results/cold-start.json and docs/results/cold-start.png; docs/online-learning.md quotes them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

DOCS = harness.RESULTS

ADMIN_KEY = "cold-start-bench"  # servers on 127.0.0.1 only: each block's end reads /admin/drafts (learning share, headroom)
CONFIGS = {"fresh": ["--draft", "hybrid:fresh", "--router", "single"], "fresh-domain": ["--draft", "hybrid:fresh"], "packaged": ["--draft", "hybrid"], "suffix": ["--draft", "suffix"],
           "alone": ["--draft", "none"], "static": ["--draft", "hybrid", "--static"],
           "index": ["--draft", "hybrid", "--no-head-updates"],  # learning: the suffix index only (no records, no updates)
           "fresh-alpha": ["--draft", "hybrid:fresh", "--router", "single", "--gate-metric", "alpha"],  # the cold head's gate ('auto')
           "fresh-replayed": ["--draft", "hybrid:fresh", "--router", "single", "--gate-metric", "replayed"]}  # the default of ff03c9f-852b8ec


def online_split(n: int, domains: list[str], segments: bool = False) -> list:
    """``n`` online-split requests (the traffic a server learns from), ``domains`` in turn, or
    with ``segments`` one domain after another (a shift at each boundary), n / len(domains) each."""
    from onlinespec.data.sources import stream_pools
    from onlinespec.data.splits import split

    pools = {d: split(q, "online") for d, q in stream_pools(domains).items()}
    for d, pool in pools.items():
        random.Random(f"0:{d}").shuffle(pool)
    per = -(-n // len(domains))
    short = {d: len(p) for d, p in pools.items() if len(p) < per}
    if short:
        raise SystemExit(f"--n {n} needs {per} requests per domain; the online split holds {short}")
    if segments:
        return [pools[d][i] for d in domains for i in range(per)][:n]
    return [pools[domains[i % len(domains)]][i // len(domains)] for i in range(n)]


class Paused:
    """A started server, paused (SIGSTOP) except while it serves a block."""

    def __init__(self, name: str, server: harness.Served) -> None:
        self.name, self.server = name, server
        self.client = harness.client(server, 1800)
        self.model = self.client.models.list().data[0].id
        self.rows: dict[int, dict] = {}
        self.walls: dict[int, float] = {}  # block -> seconds it took
        self.learning: dict[int, dict] = {}  # block -> the server's learning state at its end (share, headroom, backoff)
        self.pause()

    def pause(self) -> None:
        self.server.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.server.process.send_signal(signal.SIGCONT)

    def play(self, block: int, queries, indices: list[int], arrivals: list[float] | None, max_tokens: int, in_flight: int) -> float:
        """Serve ``indices`` at their arrival gaps (open loop), or ``in_flight`` at a time (closed
        loop: ``arrivals`` None), wait for every answer; wall seconds."""
        import httpx
        from serve_load import send

        self.resume()
        start, threads = time.perf_counter(), []

        def one(i: int) -> None:
            self.rows[i] = send(self.client, self.model, queries[i], max_tokens, headers={"X-Request-Id": f"cold-{i}"})

        if arrivals is None:
            with ThreadPoolExecutor(in_flight) as pool:
                list(pool.map(one, indices))
        else:
            offset = arrivals[indices[0]]
            for i in indices:
                time.sleep(max(0.0, start + arrivals[i] - offset - time.perf_counter()))
                thread = threading.Thread(target=one, args=(i,), daemon=True)
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
        self.walls[block] = seconds = time.perf_counter() - start
        self.learning[block] = httpx.get(self.server + "/admin/drafts", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                         timeout=60).json()["learning"]
        return seconds


def capacity(args, queries, out: Path) -> float:
    """The target alone's requests per second at ``--max-batch`` in flight (closed loop)."""
    from serve_load import run_level

    with harness.serve_onlinespec(["--draft", "none", "--out-dir", str(out / "probe"), "--max-batch", str(args.max_batch), *args.server_args],
                                  log_path=out / "probe.log") as url:
        client = harness.client(url, 600)
        model = client.models.list().data[0].id
        level = run_level(client, model, queries, args.max_tokens, args.max_batch)
    print(f"target alone: {level['requests_per_s']:.3f} requests/s, {level['tokens_per_s']:.1f} tokens/s at {args.max_batch} in flight",
          flush=True)
    return level["requests_per_s"]


def interleaved(names: list[str], args, queries, arrivals: list[float] | None, out: Path) -> dict:
    """Every configuration over the trace, block by block in turn; {name: (rows, updates, controller events, block walls,
    learning state at each block's end)}."""
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in names:
            shutil.rmtree(out / name, ignore_errors=True)  # every run starts from nothing learnt
            served = stack.enter_context(harness.serve_onlinespec(
                [*CONFIGS[name], "--out-dir", str(out / name), "--max-batch", str(args.max_batch), "--max-waiting", "512",
                 "--admin-key", ADMIN_KEY, *args.server_args], log_path=out / f"{name}.log"))
            stack.callback(served.process.send_signal, signal.SIGCONT)  # resumed before it is asked to stop
            servers[name] = Paused(name, served)
            print(f"[{name}] ready, paused", flush=True)
        n_blocks = -(-len(queries) // args.block)
        started = time.perf_counter()
        for b in range(n_blocks):
            indices = list(range(b * args.block, min(len(queries), (b + 1) * args.block)))
            for name in harness.rotated(names, b):
                if name == "alone" and b % args.alone_every:
                    continue
                seconds = servers[name].play(b, queries, indices, arrivals, args.max_tokens, args.in_flight)
                errors = sum(servers[name].rows[i]["error"] is not None for i in indices)
                print(f"block {b + 1}/{n_blocks} [{name}] {len(indices)} requests in {seconds:.0f} s, {errors} errors "
                      f"({time.perf_counter() - started:.0f} s so far)", flush=True)
    results = {}
    for name, paused in servers.items():
        logged = [json.loads(line) for line in (out / name / "events.jsonl").read_text().splitlines()]
        by_id = {e["id"]: e for e in logged if e["event"] == "request"}  # the server's log has each request's speculation figures
        rows = []
        for i, r in sorted(paused.rows.items()):
            row = {"i": i, "id": queries[i].id, "domain": queries[i].domain, **{k: r[k] for k in ("error", "tokens", "latency_s", "ttft_s", "text")}}
            event = by_id.get(f"cold-{i}")
            if event is not None:
                row.update(alpha=event["alpha"], tau=event["tau"], draft_version=event["draft_version"])
            rows.append(row)
        updates = [e for e in logged if e["event"] == "update"]
        control = [e for e in logged if e["event"] == "learn_control"]
        print(f"[{name}] {len(updates)} updates ({sum(1 for u in updates if u.get('version'))} published), "
              f"{len(control)} controller decisions", flush=True)
        results[name] = rows, updates, control, paused.walls, paused.learning
    return results


def blocks(rows: list[dict], size: int, walls: dict[int, float]) -> list[dict]:
    from onlinespec.metrics import percentile

    out = []
    for b in sorted({r["i"] // size for r in rows}):
        block = [r for r in rows if r["i"] // size == b]
        part = [r for r in block if r["error"] is None and r["tokens"] > 1]
        tpot = [(r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in part]
        out.append({"requests": f"{b * size + 1}-{b * size + len(block)}", "alpha": sum(r.get("alpha", 0) for r in part) / max(1, len(part)),
                    "tau": sum(r.get("tau", 1) for r in part) / max(1, len(part)),
                    "tpot_p50_ms": 1000 * percentile(tpot, 50) if tpot else None,
                    "ttft_p50_s": percentile([r["ttft_s"] for r in part], 50) if part else None,
                    "errors": sum(r["error"] is not None for r in block),
                    "tokens_per_s": sum(r["tokens"] for r in part) / walls[b] if walls.get(b) else None})
    return out


def window(rows: list[dict], first: int, last: int) -> dict:
    """alpha, tau (means over requests) and TPOT p50 over requests ``first``..``last`` (1-based, inclusive)."""
    from onlinespec.metrics import percentile

    part = [r for r in rows if first <= r["i"] + 1 <= last and r["error"] is None and r["tokens"] > 1]
    if not part:
        return {}
    tpot = [(r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in part]
    return {"requests": f"{first}-{last}", "n": len(part), "alpha": sum(r.get("alpha", 0) for r in part) / len(part),
            "tau": sum(r.get("tau", 1) for r in part) / len(part), "tpot_p50_ms": 1000 * percentile(tpot, 50)}


def paired_thirds(rows: dict[str, list[dict]], domains: list[str], against: str = "static") -> dict:
    """A shifted trace (``--segments``): for each configuration but ``against``, per third of each
    domain's segment, over the same requests on both servers: mean alpha of each, their paired
    difference with its one-sided 95% lower bound, the median per-request decode rate (tokens
    after the first over the time after the first token) as a ratio, and the draft versions that
    served. Issue 47's floor reads the bound; its speed figure, the decode-rate ratio."""
    import statistics

    if against not in rows:
        return {}
    base = {r["id"]: r for r in rows[against] if r["error"] is None and r["tokens"] > 1}
    per = -(-len(rows[against]) // len(domains))

    def rate(r):
        return (r["tokens"] - 1) / max(1e-9, r["latency_s"] - r["ttft_s"])

    def alpha(r):
        return r.get("alpha") or 0.0  # None: nothing proposed

    out = {}
    for name, own in rows.items():
        if name == against:
            continue
        mine = {r["id"]: r for r in own if r["error"] is None and r["tokens"] > 1}
        order = [r["id"] for r in sorted(own, key=lambda r: r["i"])]
        thirds = []
        for s, domain in enumerate(domains):
            segment = order[s * per:(s + 1) * per]
            for t in range(3):
                ids = [i for i in segment[t * len(segment) // 3:(t + 1) * len(segment) // 3] if i in mine and i in base]
                diffs = [alpha(mine[i]) - alpha(base[i]) for i in ids]
                if len(diffs) < 2:
                    continue
                mean, error = statistics.mean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
                thirds.append({"segment": domain, "third": t + 1, "n": len(ids),
                               "alpha": statistics.mean(alpha(mine[i]) for i in ids),
                               f"alpha_{against}": statistics.mean(alpha(base[i]) for i in ids),
                               "alpha_diff": mean, "alpha_diff_lower_95": mean - 1.645 * error,
                               "decode_rate_ratio": statistics.median(rate(mine[i]) for i in ids) / statistics.median(rate(base[i]) for i in ids),
                               "versions": sorted({str(mine[i].get("draft_version")) for i in ids})})
        out[name] = thirds
    return out


def verdicts(runs: dict, n: int) -> dict:
    """The issue's cold-start targets, from the windows."""
    out = {}
    last = {name: run["windows"].get("last_200", {}) for name, run in runs.items()}
    if last.get("fresh") and last.get("packaged"):
        out["alpha_gap_last_200"] = last["packaged"]["alpha"] - last["fresh"]["alpha"]
        out["tpot_ratio_last_200"] = last["fresh"]["tpot_p50_ms"] / last["packaged"]["tpot_p50_ms"]
    early = {name: run["windows"].get("201_300", {}) for name, run in runs.items()}
    if all(early.get(k) for k in ("fresh", "packaged", "suffix")):
        gain = early["packaged"]["alpha"] - early["suffix"]["alpha"]
        out["fresh_share_of_packaged_gain_at_300"] = (early["fresh"]["alpha"] - early["suffix"]["alpha"]) / gain if gain else None
    return out


def plot(summary: dict, path: Path) -> None:
    fig, axes = harness.figure(1, 3, figsize=(15, 4))
    for name, run in summary["runs"].items():
        x = [int(b["requests"].split("-")[1]) for b in run["blocks"]]
        style = {"marker": "o", "label": "target alone" if name == "alone" else name, "ls": ":" if name == "alone" else "-"}
        if name != "alone":
            axes[0].plot(x, [b["alpha"] for b in run["blocks"]], **style)
        axes[1].plot(x, [b["tau"] for b in run["blocks"]], **style)
        axes[2].plot(x, [b["tpot_p50_ms"] for b in run["blocks"]], **style)
    axes[0].set(title="acceptance (alpha) by block", xlabel="requests served", ylabel="alpha")
    axes[1].set(title="tokens per target forward (tau)", xlabel="requests served")
    axes[2].set(title="TPOT p50 (servers interleaved by block)", xlabel="requests served", ylabel="ms")
    for ax in axes:
        ax.legend(fontsize=8)
    load = (f"{summary['in_flight']} in flight (closed loop)" if summary.get("in_flight") else
            f"{summary['load']:.0%} of target-alone capacity, {summary['rate_per_s']:.2f} requests/s")
    fig.suptitle(f"{summary.get('domains', 'chat,code,math_ml')} at {load} ({summary['machine']['date']})")
    harness.save(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--load", type=float, default=0.6, help="arrival rate, as a fraction of the target alone's capacity")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--configs", default="fresh,packaged,suffix,alone", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--domains", default="chat,code,math_ml", help="online-split domains, in turn")
    parser.add_argument("--segments", action="store_true", help="the domains one after another (a shift at each boundary), not in turn")
    parser.add_argument("--in-flight", type=int, default=None, help="closed loop: this many requests in flight (no arrival trace, no capacity probe)")
    parser.add_argument("--alone-every", type=int, default=4, help="the target alone serves every N-th block")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `onlinespec serve` flags for every server")
    parser.add_argument("--out", default="runs/cold-start")
    parser.add_argument("--json", type=Path, default=DOCS / "cold-start.json")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if args.report_only:
        summary = json.loads(args.json.read_text())
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        queries = online_split(args.n, args.domains.split(","), args.segments)
        rate, arrivals = None, None
        if args.in_flight is None:
            rate, arrivals, t, rng = args.load * capacity(args, queries[: 4 * args.max_batch], out), [], 0.0, random.Random(0)
            for _ in queries:
                t += rng.expovariate(rate)
                arrivals.append(t)
        names = args.configs.split(",")
        runs, texts, all_rows = {}, {}, {}
        for name, (rows, updates, control, walls, learning) in interleaved(names, args, queries, arrivals, out).items():
            texts[name], all_rows[name] = {r["id"]: r["text"] for r in rows}, rows
            n = len(queries)
            runs[name] = {"blocks": blocks(rows, args.block, walls), "updates": len(updates),
                          "tokens_per_s": sum(r["tokens"] for r in rows if r["error"] is None) / sum(walls.values()),
                          "published": sum(1 for u in updates if u.get("version")), "controller": control,
                          "learning_by_block": [learning[b] for b in sorted(learning)],
                          "windows": {"201_300": window(rows, 201, 300), "last_200": window(rows, max(1, n - 199), n)},
                          "text_sha256": {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in texts[name].items()}}
        reference = texts.get("alone", {})
        for name, run in runs.items():  # greedy: every configuration's text against the target alone's, where it served
            same = [k for k in reference if k in texts[name]]
            run["identical_to_alone"] = f"{sum(texts[name][k] == reference[k] for k in same)}/{len(same)}"
        summary = {"n": args.n,
                   "load": None if args.in_flight else args.load, "in_flight": args.in_flight, "domains": args.domains,
                   "segments": args.segments,
                   "paired_thirds": paired_thirds(all_rows, args.domains.split(",")) if args.segments else None,
                   # against the per-domain drafts' suffix indexes alone: what the head's own learning added
                   "paired_thirds_index": paired_thirds(all_rows, args.domains.split(","), against="index") if args.segments else None,
                   "rate_per_s": rate, "block": args.block, "max_tokens": args.max_tokens, "server_args": args.server_args,
                   "verdicts": verdicts(runs, args.n), "runs": runs}
        summary = json.loads(harness.write_result(args.json, summary).read_text())
    plot(summary, args.json.with_suffix(".png"))
    print(json.dumps({"verdicts": summary.get("verdicts"), **{name: run["blocks"] for name, run in summary["runs"].items()}}, indent=1))


if __name__ == "__main__":
    main()
