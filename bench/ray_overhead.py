"""What Ray itself costs: the same requests through `onlinespec serve` in one process and on Ray.

Three servers on the real default target, one at a time on this machine, each sent the same
held-out requests from the real `openai` client (streamed, greedy, N in flight), drafts kept
static so that every server serves the same draft: the single-process server, `--replicas 1`
(the same serving core in one Ray actor behind the same app: the cost of Ray itself) and
`--replicas 2` (two cores, each with half the CPUs). The single-process server and `--replicas 1`
run twice, interleaved (single, ray-1, ray-2, single, ray-1), so that drift of the machine shows.

    python bench/ray_overhead.py                  # 48 streamed requests, 8 in flight, batches of 4, 32 tokens (~11 min here)
    python bench/ray_overhead.py --whole          # the same, answered whole (the demo's kind of request)
    python bench/ray_overhead.py --report-only    # rewrite the PNG from the JSON
    python bench/ray_overhead.py --paired --n 480 --block 24   # both servers up at once, blocks alternated (~20 min)

``--paired`` is the low-noise design: this machine's speed drifts by up to 20% within minutes, so
servers run one after the other differ by more than Ray costs. Both servers are started (each
with the whole model), then the same block of requests goes to one and then the other, the first
server alternating, block after block: each pair of blocks is measured within a minute, and the
ratio's interval is a bootstrap over pairs. The idle server waits meanwhile (a local Ray cluster's
daemons spend a little CPU idle: counted in the JSON, under the single server's blocks).

Writes docs/results/ray-overhead-streamed.{json,png} (or -whole); docs/scale.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from serve_load import held_out, run_level, send

DOCS = harness.RESULTS
SERVERS = {"single": ["--static"], "ray-1": ["--static", "--replicas", "1"], "ray-2": ["--static", "--replicas", "2"]}
ORDER = ("single", "ray-1", "ray-2", "single", "ray-1")


def send_whole(client, model: str, query, max_tokens: int) -> dict:
    """One greedy request answered whole (no stream): what the client saw, in send()'s shape."""
    started = time.perf_counter()
    error, text, tokens = None, "", 0
    try:
        kwargs = {"model": model, "max_tokens": max_tokens, "temperature": 0, "extra_body": {"domain": query.domain}}
        if query.messages:
            response = client.chat.completions.create(messages=list(query.messages), **kwargs)
            text = response.choices[0].message.content
        else:
            response = client.completions.create(prompt=query.prompt, **kwargs)
            text = response.choices[0].text
        tokens = response.usage.completion_tokens
    except Exception as err:  # noqa: BLE001 (counted, never hidden)
        error = f"{type(err).__name__}: {err}"
    end = time.perf_counter()
    return {"id": query.id, "text": text, "latency_s": end - started, "ttft_s": end - started, "tokens": tokens, "error": error,
            "start": started, "end": end}


def process_cpu(root: int) -> dict[tuple[int, int], tuple[str, float, float, int]]:
    """What every thread of a process and its descendants has had so far: (pid, tid) ->
    ("process name/thread name", CPU seconds (user + system), seconds runnable but waiting for a
    CPU (schedstat), times preempted (nonvoluntary context switches)). A local Ray cluster's
    processes (GCS, raylet, workers) descend from the server that started it."""
    import psutil

    out = {}
    try:
        top = psutil.Process(root)
        family = [top, *top.children(recursive=True)]
    except psutil.Error:
        return out
    for process in family:
        try:
            name = process.name()
            for thread in process.threads():
                task = Path(f"/proc/{process.pid}/task/{thread.id}")
                try:
                    comm = (task / "comm").read_text().strip()
                    waited = int((task / "schedstat").read_text().split()[1]) / 1e9  # runnable, but no CPU to run on
                    status = (task / "status").read_text()
                    preempted = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
                except (OSError, IndexError, ValueError):
                    comm, waited, preempted = "?", 0.0, 0
                out[(process.pid, thread.id)] = (f"{name}/{comm}", thread.user_time + thread.system_time, waited, preempted)
        except psutil.Error:  # it ended meanwhile
            continue
    return out


def cpu_spent(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """What each kind of thread had between two :func:`process_cpu` snapshots, by "process/thread"
    name (threads of one name added up): ``cpu`` seconds (most first), ``waited`` seconds and
    ``preempted`` times."""
    spent: dict[str, list[float]] = {}
    for key, (name, *now) in after.items():
        then = before.get(key, (name, 0.0, 0.0, 0))[1:]
        total = spent.setdefault(name, [0.0, 0.0, 0])
        for i, (a, b) in enumerate(zip(then, now)):
            total[i] += b - a
    kept = sorted(((n, t) for n, t in spent.items() if t[0] > 0.05), key=lambda kv: -kv[1][0])
    return {"cpu": {n: round(t[0], 2) for n, t in kept}, "waited": {n: round(t[1], 2) for n, t in kept},
            "preempted": {n: int(t[2]) for n, t in kept}}


def server_args(name: str, args, out: Path, n: int) -> list[str]:
    """`onlinespec serve`'s arguments for server ``name`` (SERVERS), writing to ``out``."""
    return [*SERVERS[name], "--out-dir", str(out), "--max-batch", str(args.max_batch), "--max-waiting", str(n),
            "--default-max-tokens", str(args.max_tokens)]


def warmed_client(server: str, queries) -> tuple:
    """An `openai` client of a ready server and its model's name, after a warm-up not measured."""
    client = harness.client(server, 600)
    model = client.models.list().data[0].id
    for q in queries[:4]:
        send(client, model, q, 8)
    return client, model


def serve(name: str, args, queries, work: Path, round_: int) -> dict:
    command = server_args(name, args, work / f"{name}-{round_}", len(queries))
    print(f"[{name} #{round_}] onlinespec serve {' '.join(command)}", flush=True)
    started = time.perf_counter()
    with harness.serve_onlinespec(command, log_path=work / f"{name}-{round_}.log") as server:
        ready = time.perf_counter() - started
        client, model = warmed_client(server, queries)
        before = process_cpu(server.process.pid)
        level = run_level(client, model, queries, args.max_tokens, args.concurrency)
        cpu = cpu_spent(before, process_cpu(server.process.pid))
    print(f"[{name} #{round_}] {level['tokens_per_s']:.2f} tok/s, p50 {level['latency_p50_s']:.2f} s, errors {level['errors']}, "
          f"ready in {ready:.0f} s; by thread, CPU s {cpu['cpu']}, waiting for a CPU s {cpu['waited']}, preempted {cpu['preempted']}", flush=True)
    return {**level, "ready_s": ready, "cpu_seconds": cpu["cpu"], "waited_seconds": cpu["waited"], "preempted": cpu["preempted"]}


def paired(args, queries, work: Path) -> dict:
    """Both servers up; each block of ``args.block`` requests sent to one, then the other."""
    import contextlib

    from onlinespec.metrics import bootstrap_ratio

    names = ("single", "ray-1")
    with contextlib.ExitStack() as stack:
        servers, clients = {}, {}
        for name in names:
            command = server_args(name, args, work / f"paired-{name}", len(queries))
            print(f"[{name}] onlinespec serve {' '.join(command)}", flush=True)
            servers[name] = stack.enter_context(harness.serve_onlinespec(command, log_path=work / f"paired-{name}.log"))
            clients[name] = warmed_client(servers[name], queries)
        both = [servers[n].process.pid for n in names]
        blocks = [queries[i:i + args.block] for i in range(0, len(queries), args.block)]
        pairs, cpu, texts = [], {n: {} for n in names}, {n: {} for n in names}
        for i, block in enumerate(blocks):
            pair = {}
            for name in (names if i % 2 == 0 else names[::-1]):
                before = {pid: process_cpu(pid) for pid in both}
                level = run_level(*clients[name], block, args.max_tokens, args.concurrency)
                for pid in both:  # the idle server's threads too: what it costs the other
                    for kind, spent in cpu_spent(before[pid], process_cpu(pid)).items():
                        for thread, value in spent.items():
                            label = f"{'self' if pid == servers[name].process.pid else 'idle server'}: {thread}"
                            cpu[name].setdefault(kind, {})[label] = round(cpu[name].get(kind, {}).get(label, 0) + value, 2)
                texts[name].update(level.pop("texts"))
                pair[name] = level
            ratio = pair["ray-1"]["tokens_per_s"] / pair["single"]["tokens_per_s"]
            pairs.append({"block": i, "first": names[i % 2], "ratio": ratio,
                          **{n: {k: pair[n][k] for k in ("tokens", "wall_s", "tokens_per_s", "errors", "latency_p50_s", "ttft_p50_s")} for n in names}})
            print(f"[block {i + 1}/{len(blocks)}] single {pair['single']['tokens_per_s']:.1f} tok/s, ray-1 {pair['ray-1']['tokens_per_s']:.1f}: "
                  f"{ratio:.3f}x", flush=True)
    samples = [(p["ray-1"]["tokens"], p["ray-1"]["wall_s"], p["single"]["tokens"], p["single"]["wall_s"]) for p in pairs]
    pooled = (sum(s[0] for s in samples) / sum(s[1] for s in samples)) / (sum(s[2] for s in samples) / sum(s[3] for s in samples))
    return {"config": {"n": len(queries), "block": args.block, "concurrency": args.concurrency, "max_batch": args.max_batch,
                       "max_new_tokens": args.max_tokens, "servers": {n: SERVERS[n] for n in names}, "streamed": not args.whole},
            "ray-1/single": {"pooled": pooled, "interval_95": list(bootstrap_ratio(samples)),
                             "median_of_pairs": statistics.median(p["ratio"] for p in pairs)},
            "identical": sum(texts["ray-1"][q.id] == texts["single"][q.id] for q in queries),
            "errors": {n: sum(p[n]["errors"] for p in pairs) for n in names},
            "cpu": {n: {kind: dict(sorted(v.items(), key=lambda kv: -kv[1])[:12]) for kind, v in cpu[n].items()} for n in names},
            "pairs": pairs}


def plot_paired(summary: dict, path: Path) -> None:
    pairs, r = summary["pairs"], summary["ray-1/single"]
    fig, (top, bottom) = harness.figure(2, 1, figsize=(7, 5), sharex=True)
    x = [p["block"] + 1 for p in pairs]
    top.plot(x, [p["single"]["tokens_per_s"] for p in pairs], "o-", label="one process", color="#4c72b0")
    top.plot(x, [p["ray-1"]["tokens_per_s"] for p in pairs], "s-", label="--replicas 1", color="#dd8452")
    top.set_ylabel("tokens/s in the block")
    top.legend(fontsize=8)
    bottom.plot(x, [p["ratio"] for p in pairs], "o", color="#444444")
    bottom.axhline(r["pooled"], color="#dd8452", label=f"pooled {r['pooled']:.3f}x (95% {r['interval_95'][0]:.3f}-{r['interval_95'][1]:.3f})")
    bottom.axhspan(*r["interval_95"], color="#dd8452", alpha=0.2)
    bottom.axhline(0.9, color="red", linestyle=":", label="within 10%")
    bottom.set_ylabel("ray-1 / one process")
    bottom.set_xlabel("block (the same requests to both servers, one after the other)")
    bottom.legend(fontsize=8, loc="lower left")
    bottom.xaxis.get_major_locator().set_params(integer=True)
    c = summary["config"]
    top.set_title(f"Ray's cost, paired blocks: {c['n']} requests in blocks of {c['block']}, {c['concurrency']} in flight, "
                  f"{c['max_new_tokens']} tokens, {'streamed' if c['streamed'] else 'whole'}", fontsize=9)
    harness.save(fig, path)


def summarize(runs: list[tuple[str, dict]], args, queries) -> dict:
    by = {name: [r for n, r in runs if n == name] for name in SERVERS}
    base = by["single"][0]["texts"]
    identical = {f"{n}#{i}": sum(r["texts"][q.id] == base[q.id] for q in queries) for n, rs in by.items() for i, r in enumerate(rs)}
    rates = {name: [r["tokens_per_s"] for r in rs] for name, rs in by.items()}
    pairs = list(zip(by["single"], by["ray-1"]))  # round i of each
    return {
        "config": {"n": len(queries), "concurrency": args.concurrency, "max_batch": args.max_batch, "max_new_tokens": args.max_tokens, "servers": SERVERS, "order": args.order.split(","),
                   "streamed": not args.whole},
        "tokens_per_s": rates,
        "ray-1/single": {"per_round": [b["tokens_per_s"] / a["tokens_per_s"] for a, b in pairs],
                         "median": statistics.median(b["tokens_per_s"] / a["tokens_per_s"] for a, b in pairs),
                         "latency_p50_per_round": [b["latency_p50_s"] / a["latency_p50_s"] for a, b in pairs]},
        "ray-2/single": by["ray-2"][0]["tokens_per_s"] / statistics.median(rates["single"]) if by["ray-2"] else None,
        "ready_s": {name: [r["ready_s"] for r in rs] for name, rs in by.items()},
        "errors": {name: sum(r["errors"] for r in rs) for name, rs in by.items()},
        "identical_to_first_single": identical,
        "runs": [{"server": n, **{k: v for k, v in r.items() if k != "texts"}} for n, r in runs],
    }


def plot(summary: dict, path: Path) -> None:
    fig, ax = harness.figure(figsize=(7, 3.6))
    runs = summary["runs"]
    colours = {"single": "#4c72b0", "ray-1": "#dd8452", "ray-2": "#55a868"}
    ax.bar(range(len(runs)), [r["tokens_per_s"] for r in runs], color=[colours[r["server"]] for r in runs])
    ax.set_xticks(range(len(runs)), [f"{r['server']}\n(run {i + 1})" for i, r in enumerate(runs)])
    ax.set_ylabel("tokens/s (all requests, wall clock)")
    c = summary["config"]
    ax.set_title(f"Ray's cost: {c['n']} requests, {c['concurrency']} in flight, batches of {c.get('max_batch', c['concurrency'])}, "
                 f"{c['max_new_tokens']} tokens; "
                 f"ray-1/single {summary['ray-1/single']['median']:.3f}x", fontsize=9)
    harness.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (more than --max-batch: a queue keeps every batch full)")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path("runs/ray-overhead"))
    parser.add_argument("--out", type=Path, default=None, help="writes OUT.json and OUT.png (default: docs/results/ray-overhead-streamed or -whole)")
    parser.add_argument("--whole", action="store_true", help="answers whole instead of streamed (one relayed event per request)")
    parser.add_argument("--order", default=",".join(ORDER), help="the servers to run, in order")
    parser.add_argument("--paired", action="store_true", help="both servers up at once, the same blocks of requests alternated between them")
    parser.add_argument("--block", type=int, default=24, help="requests per block with --paired")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    args.out = args.out or DOCS / ("ray-overhead-whole" if args.whole else "ray-overhead-paired" if args.paired else "ray-overhead-streamed")
    path = args.out.with_suffix(".json")
    if args.whole:
        import serve_load

        serve_load.send = send_whole  # run_level sends through it (the warm-up still streams)
    if args.paired:
        if not args.report_only:
            args.work.mkdir(parents=True, exist_ok=True)
            harness.write_result(path, paired(args, held_out(args.n), args.work))
        summary = json.loads(path.read_text())
        plot_paired(summary, args.out.with_suffix(".png"))
        r = summary["ray-1/single"]
        print(f"ray-1/single tokens/s, pooled over {len(summary['pairs'])} paired blocks: {r['pooled']:.3f}x (95% "
              f"{r['interval_95'][0]:.3f}-{r['interval_95'][1]:.3f}); median of blocks {r['median_of_pairs']:.3f}x; "
              f"identical {summary['identical']}/{summary['config']['n']}; errors {summary['errors']}")
        return
    if not args.report_only:
        queries = held_out(args.n)
        args.work.mkdir(parents=True, exist_ok=True)
        runs = [(name, serve(name, args, queries, args.work, i)) for i, name in enumerate(args.order.split(","))]
        harness.write_result(path, summarize(runs, args, queries))
    summary = json.loads(path.read_text())
    plot(summary, args.out.with_suffix(".png"))
    r = summary["ray-1/single"]
    print(f"ray-1/single tokens/s: {r['median']:.3f}x (rounds {', '.join(f'{x:.3f}' for x in r['per_round'])}); "
          f"ray-2/single {summary['ray-2/single'] or 0:.3f}x; identical {summary['identical_to_first_single']}; errors {summary['errors']}")


if __name__ == "__main__":
    main()
