"""The abuse benchmark (issue 46, "Must show"): two tenants with their own API keys on one
`onlinespec serve` (127.0.0.1 only, the packaged default target and draft). Tenant A's
well-behaved clients stream chat requests; tenant B's clients send the worst valid requests we
can write, each client the engine's kinds round-robin on one connection and the transport's on
another, at once:

* 16 choices, `ignore_eos`, no `max_tokens` (each runs to `--default-max-tokens` or the context),
  with 16 stop strings of 1,000 characters each;
* a ~4k-token prompt with `echo` and `logprobs` (the most alternatives the prompt log-probability
  cap allows at that length), no `max_tokens`;
* a body trickled a byte a second (the server's `--body-timeout` answers 408);
* a flood of requests naming other tenants in the tenant header (each a 403).

The run is bounded (`--minutes`, default 10) and stops by itself. `--baseline` runs tenant A
alone (no tenant B) and writes OUT-baseline.json; a run with B then reports A's TTFT p50/p99 and
TPOT p50 as ratios to it, A's failed requests, B's share of the generated tokens while B had
work queued (from each request's tokens spread over its streaming time), and the server's peak
resident memory.

    python bench/abuse.py --baseline --minutes 10     # tenant A alone
    python bench/abuse.py --minutes 10                # A and B; ratios against the baseline
    python bench/abuse.py --minutes 1 --out runs/abuse/quick   # a quick look (not a measurement)
    python bench/abuse.py --minutes 1 --b-kinds echo4k --py-spy PATH   # one kind of B's requests; the server's stacks

``--b-kinds`` picks B's kinds (comma-separated; default all four), to find which one hurts A;
``--py-spy`` records the server's threads with a py-spy binary (``pip download py-spy``) into
WORK/profile.txt (collapsed stacks), where the engine thread's time goes while A waits.

Writes OUT.json and OUT.png (default docs/results/abuse); docs/reliability.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "results"
sys.path.insert(0, str(ROOT / "bench"))

KEYS = {"A": "abuse-key-of-a", "B": "abuse-key-of-b"}
ADMIN = "abuse-admin"
LONG_STOP = [(f"{i:02d}" + "never appears in the output " * 36)[:1000] for i in range(16)]  # 16 stops of 1,000 characters (the limit)
PROMPT_WORDS = 3900  # about 4k tokens of the default tokenizer: "word " is one token
ECHO_ALTERNATIVES = 7  # 3,900 x (1 + 7) stays under the server's 32,768 prompt log-probability entries
B_KINDS = ("n16", "echo4k", "trickle", "header-flood")  # tenant B's requests, round-robin (--b-kinds picks some)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Record:
    """What the clients saw, under a lock: A's requests, B's, and token events for the shares."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.a: list[dict] = []
        self.b: list[dict] = []
        self.b_refused: dict[int, int] = {}  # status -> count, for B's requests

    def add(self, tenant: str, row: dict) -> None:
        with self.lock:
            (self.a if tenant == "A" else self.b).append(row)


def tenant_a(server_url: str, model: str, queries: list, deadline: float, record: Record, max_tokens: int, seed: int) -> None:
    """A well-behaved client: one streamed greedy chat request after another."""
    import openai
    from serve_load import send

    client = openai.OpenAI(base_url=server_url + "/v1", api_key=KEYS["A"], max_retries=0, timeout=600)
    i = seed
    while time.monotonic() < deadline:
        q = queries[i % len(queries)]
        i += 4
        r = send(client, model, q, max_tokens)
        tpot = (r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) if r["tokens"] > 1 else None
        record.add("A", {"start": r["start"], "end": r["end"], "ttft_s": r["ttft_s"], "tpot_s": tpot, "tokens": r["tokens"], "error": r["error"]})


def streamed(http, url: str, body: dict, record: Record, kind: str) -> None:
    """One of B's streamed requests: its status, times, and per choice its text and the times of
    its first and last chunks (its tokens are counted at the end: the usage chunk when the request
    finished, else its text re-tokenised, :func:`count_b_tokens`)."""
    started = time.perf_counter()
    first, tokens, status = None, None, None
    texts: dict[int, list] = {}  # choice -> [text, first chunk, last chunk]
    try:
        with http.stream("POST", url + "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
            status = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                for choice in chunk.get("choices") or ():
                    first = first or now
                    entry = texts.setdefault(choice["index"], ["", now, now])
                    entry[0] += choice.get("text") or ""
                    entry[2] = now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except Exception as err:  # counted, never hidden
        status = f"{type(err).__name__}"
    end = time.perf_counter()
    record.add("B", {"start": started, "first": first or end, "end": end, "tokens": tokens, "status": status, "kind": kind,
                     "choices": [texts[i] for i in sorted(texts)], "echo": bool(body.get("echo"))})


def trickle(url: str, seconds: float) -> str:
    """Headers, then a body a byte a second: the server's answer (its first line) or what happened."""
    host, port = url.removeprefix("http://").split(":")
    body = b'{"model": "default", "prompt": "a"}'
    with socket.create_connection((host, int(port)), timeout=seconds) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["B"].encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        try:
            for byte in body:
                sock.sendall(bytes([byte]))
                time.sleep(1.0)
                try:
                    answer = sock.recv(200, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                return answer.split(b"\r\n")[0].decode(errors="replace") or "closed"
            return sock.recv(200).split(b"\r\n")[0].decode(errors="replace") or "closed"
        except OSError as err:  # the server answered and closed
            return f"closed ({type(err).__name__})"


ENGINE_KINDS = ("n16", "echo4k")  # what the engine serves (a request can hold it for minutes)


def tenant_b(server_url: str, model: str, deadline: float, record: Record, seed: int, kinds: tuple[str, ...] = B_KINDS) -> None:
    """An abusive client: the worst valid requests (``kinds`` of them) until the deadline, on two
    connections at once: the engine's kinds round-robin on one, the transport's (trickled bodies,
    header floods) round-robin on the other. One 16-choice request or one paced 4k-token scored
    prompt can take the whole run, and a client that waited for it would never trickle or flood."""
    engine, transport = [k for k in kinds if k in ENGINE_KINDS], [k for k in kinds if k not in ENGINE_KINDS]
    side = threading.Thread(target=_b_loop, args=(server_url, model, deadline, record, seed, transport), daemon=True)
    if transport:
        side.start()
    if engine:
        _b_loop(server_url, model, deadline, record, seed, engine)
    if transport:
        side.join(max(0.0, deadline - time.monotonic() + 90))


def _b_loop(server_url: str, model: str, deadline: float, record: Record, seed: int, kinds: list[str]) -> None:
    """One of a B client's connections: ``kinds`` round-robin (from the ``seed``-th) until the deadline."""
    import httpx

    headers = {"Authorization": f"Bearer {KEYS['B']}"}
    long_prompt = "word " * PROMPT_WORDS
    i = seed
    with httpx.Client(headers=headers, timeout=3600) as http:
        while time.monotonic() < deadline:
            kind = kinds[i % len(kinds)]
            i += 1
            if kind == "n16":
                streamed(http, server_url, {"model": model, "prompt": "Tell me a story.", "n": 16, "ignore_eos": True, "stop": LONG_STOP},
                         record, kind)
            elif kind == "echo4k":
                streamed(http, server_url, {"model": model, "prompt": long_prompt, "echo": True, "logprobs": ECHO_ALTERNATIVES},
                         record, kind)
            elif kind == "trickle":
                answer = trickle(server_url, 60)
                with record.lock:
                    record.b_refused[answer] = record.b_refused.get(answer, 0) + 1
            else:
                for j in range(200):
                    status = http.post(server_url + "/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 1},
                                       headers={"X-Tenant": f"someone-else-{j}"}).status_code
                    with record.lock:
                        record.b_refused[status] = record.b_refused.get(status, 0) + 1


def sample_server(url: str, pid: int, deadline: float, samples: list) -> None:
    """Every 2 s: the server's resident memory (its children's included) and its generated-token
    counter (every tenant's: B's tokens are this less A's)."""
    import httpx
    import psutil

    process, me = psutil.Process(pid), psutil.Process()
    while time.monotonic() < deadline:
        try:
            rss = process.memory_info().rss + sum(c.memory_info().rss for c in process.children(recursive=True))
            text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).text
            cpu = (sum(process.cpu_times()[:2]), sum(me.cpu_times()[:2]))  # CPU seconds: the server's, the clients' (this process)
        except (psutil.Error, httpx.HTTPError):
            return
        generated = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("onlinespec:generation_tokens_total"))
        samples.append({"t": time.perf_counter(), "rss_bytes": rss, "generated": generated, "server_cpu_s": cpu[0], "clients_cpu_s": cpu[1]})
        time.sleep(2.0)


def cores_used(samples: list) -> dict:
    """The cores the server and the clients (this process) used on average over the run: on one
    machine, the clients' share is CPU the server did not have."""
    if len(samples) < 2:
        return {}
    span = samples[-1]["t"] - samples[0]["t"]
    return {who: round((samples[-1][f"{who}_cpu_s"] - samples[0][f"{who}_cpu_s"]) / span, 2) for who in ("server", "clients")}


def count_b_tokens(record: Record) -> None:
    """Each of B's choices' new tokens, into its row's ``choices`` entries (a 4th item): the usage
    figure when the request finished (shared by its choices in proportion to their text), else
    the choice's streamed text re-tokenised with the served tokenizer (the echoed prompt left out).
    B's long requests rarely finish within a run, and the server counts a request's tokens when
    it ends: the clients' own count is what tells the share while B's work is in flight."""
    from onlinespec.models import load_tokenizer

    tokenizer = load_tokenizer("default")
    prompt = "word " * PROMPT_WORDS
    for row in record.b:
        for entry in row["choices"]:
            text = entry[0][len(prompt):] if row["echo"] and entry[0].startswith(prompt) else entry[0]
            entry.append(len(tokenizer.encode(text, add_special_tokens=False)) if text else 0)
        counted = sum(e[3] for e in row["choices"])
        if row["tokens"] is not None and counted:  # the exact total, shared as the texts were
            for e in row["choices"]:
                e[3] = row["tokens"] * e[3] / counted


def b_share(record: Record) -> dict:
    """B's share of the tokens generated while B had a request open: each of A's requests' tokens
    spread evenly from its first token to its end, each of B's choices' from its first chunk to its
    last, summed over the times a request of B's was open."""
    busy = merge([(r["start"], r["end"]) for r in record.b])
    if not busy:
        return {"b_share_while_queued": None, "a_tokens_while_b_queued": 0, "b_tokens_while_b_queued": 0}

    def inside(s0: float, e0: float, tokens: float) -> float:
        return sum(tokens * max(0.0, min(b, e0) - max(a, s0)) / max(e0 - s0, 1e-6) for a, b in busy) if e0 > s0 else \
            (tokens if any(a <= s0 <= b for a, b in busy) else 0.0)

    a = sum(inside(r["start"] + r["ttft_s"], r["end"], r["tokens"]) for r in record.a if r["tokens"])
    b = sum(inside(e[1], e[2], e[3]) for r in record.b for e in r["choices"] if e[3])
    return {"b_share_while_queued": b / (a + b) if a + b > 0 else None, "a_tokens_while_b_queued": round(a),
            "b_tokens_while_b_queued": round(b), "b_busy_seconds": round(sum(e - s for s, e in busy), 1)}


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def run(args) -> dict:
    from serve_load import held_out

    from onlinespec.benchmark import machine_info
    from onlinespec.serve.server import ServerProcess

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "keys").write_text(f"{KEYS['A']} tenant-a\n{KEYS['B']} tenant-b\n")
    queries = [q for q in held_out(args.prompts) if q.messages] or held_out(args.prompts)
    server_args = ["--out-dir", str(work / ("run-baseline" if args.baseline else "run")), "--api-key-file", str(work / "keys"),
                   "--admin-key", ADMIN, "--tenant-header", "X-Tenant", "--max-batch", str(args.max_batch), "--body-timeout", "10",
                   *args.server_args]
    print(f"starting onlinespec serve {' '.join(server_args)}", flush=True)
    record, memory = Record(), []
    with ServerProcess(server_args, log=work / "server.log") as server:
        import httpx

        model = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['A']}"}).json()["data"][0]["id"]
        started = time.monotonic()
        deadline = started + args.minutes * 60
        threads = [threading.Thread(target=tenant_a, args=(server.url, model, queries, deadline, record, args.max_tokens, i), daemon=True)
                   for i in range(args.a_clients)]
        if not args.baseline:
            threads += [threading.Thread(target=tenant_b, args=(server.url, model, deadline, record, i, args.b_kinds), daemon=True)
                        for i in range(args.b_clients)]
        if args.py_spy:  # where the server's threads spend the run (collapsed stacks per thread; py-spy from PyPI)
            import subprocess

            spy = subprocess.Popen([str(args.py_spy), "record", "--pid", str(server.process.pid), "--rate", "20", "--threads", "--idle",
                                    "--format", "raw", "--output", str(work / "profile.txt"), "--duration", str(int(args.minutes * 60 + args.grace))],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        threads.append(threading.Thread(target=sample_server, args=(server.url, server.process.pid, deadline + args.grace, memory), daemon=True))
        for thread in threads:
            thread.start()
        for thread in threads:  # B's last requests may run past the deadline: --grace, then the server stops (and fails them)
            thread.join(max(0.0, deadline + args.grace - time.monotonic()))
        if args.py_spy:
            spy.wait(60)
    return summarise(args, record, memory, server_args, machine_info())


def summarise(args, record: Record, memory: list, server_args: list, machine: dict) -> dict:
    ok = [r for r in record.a if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    t0 = memory[0]["t"] if memory else 0.0
    statuses: dict[str, int] = {}
    if record.b:
        count_b_tokens(record)
    for r in record.b:
        key = f"{r['kind']} {r['status']}"
        statuses[key] = statuses.get(key, 0) + 1
    return {
        "command": " ".join(["python", *sys.argv]), "machine": machine, "server_args": server_args, "minutes": args.minutes,
        "baseline": args.baseline, "b_kinds": list(args.b_kinds), "a_clients": args.a_clients, "b_clients": 0 if args.baseline else args.b_clients,
        "a_requests": len(record.a), "a_failed": len(record.a) - len(ok), "a_errors": sorted({r["error"] for r in record.a if r["error"]})[:10],
        "a_ttft_p50_s": percentile(ttft, 0.5), "a_ttft_p99_s": percentile(ttft, 0.99), "a_tpot_p50_s": percentile(tpot, 0.5),
        "a_tokens": sum(r["tokens"] for r in ok), "b_requests": len(record.b), "b_statuses": statuses,
        "b_other_answers": {str(k): v for k, v in record.b_refused.items()},
        **b_share(record), "cores_used": cores_used(memory), "memory_peak_bytes": max((m["rss_bytes"] for m in memory), default=None),
        "memory": [{"t_s": round(m["t"] - t0, 1), "rss_bytes": m["rss_bytes"], "generated": m["generated"]} for m in memory],
        "a_timeline": [{"t_s": round(r["start"] - t0, 1), "ttft_s": r["ttft_s"]} for r in ok],
    }


def compare(result: dict, baseline: dict | None) -> dict:
    """A's figures as ratios to the baseline run's (None without one)."""
    if baseline is None:
        return {}
    def ratio(key: str) -> float | None:
        return result[key] / baseline[key] if result.get(key) and baseline.get(key) else None

    return {"ttft_p50_ratio": ratio("a_ttft_p50_s"), "ttft_p99_ratio": ratio("a_ttft_p99_s"), "tpot_p50_ratio": ratio("a_tpot_p50_s")}


def plot(result: dict, baseline: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run, label in ((baseline, "A alone (baseline)"), (result, "A with B abusing")):
        if run and run["a_timeline"]:
            left.plot([p["t_s"] / 60 for p in run["a_timeline"]], [p["ttft_s"] for p in run["a_timeline"]], ".", label=label, alpha=0.6)
        if run and run["memory"]:
            right.plot([m["t_s"] / 60 for m in run["memory"]], [m["rss_bytes"] / 2**20 for m in run["memory"]], label=label)
    left.set(xlabel="minutes", ylabel="tenant A's time to first token (s)", yscale="log", title="tenant A's TTFT")
    right.set(xlabel="minutes", ylabel="server RSS (MiB)", title="memory")
    left.legend()
    right.legend()
    ratios = result.get("ratios") or {}
    fig.suptitle(f"abuse: A's TTFT p50 x{ratios.get('ttft_p50_ratio') or float('nan'):.2f}, p99 x{ratios.get('ttft_p99_ratio') or float('nan'):.2f}, "
                 f"TPOT p50 x{ratios.get('tpot_p50_ratio') or float('nan'):.2f}; B's share {result.get('b_share_while_queued') or 0:.0%}; "
                 f"A failed {result['a_failed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the clients send (then the run stops by itself)")
    parser.add_argument("--baseline", action="store_true", help="tenant A alone: writes OUT-baseline.json, the reference of a run with B")
    parser.add_argument("--a-clients", type=int, default=4)
    parser.add_argument("--b-clients", type=int, default=2)
    parser.add_argument("--b-kinds", type=lambda v: tuple(k.strip() for k in v.split(",") if k.strip()), default=B_KINDS,
                        help=f"tenant B's kinds of request, comma-separated, round-robin (default: all of {','.join(B_KINDS)})")
    parser.add_argument("--max-tokens", type=int, default=64, help="tenant A's max_tokens")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--grace", type=float, default=60.0, help="seconds past --minutes the clients' last requests may take")
    parser.add_argument("--work", type=Path, default=Path("runs/abuse"))
    parser.add_argument("--out", type=Path, default=DOCS / "abuse", help="writes OUT.json and OUT.png (OUT-baseline.json with --baseline)")
    parser.add_argument("--py-spy", type=Path, default=None, help="a py-spy binary: record the server's stacks into WORK/profile.txt")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `onlinespec serve` options (last)")
    args = parser.parse_args()
    if not args.b_kinds or set(args.b_kinds) - set(B_KINDS):
        parser.error(f"--b-kinds: give some of {','.join(B_KINDS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = run(args)
    base_path = args.out.parent / f"{args.out.name}-baseline.json"
    if args.baseline:
        base_path.write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k not in ("memory", "a_timeline")}, indent=1))
        return
    baseline = json.loads(base_path.read_text()) if base_path.exists() else None
    result["ratios"] = compare(result, baseline)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, baseline, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k not in ("memory", "a_timeline")}, indent=1))
    if baseline is None:
        print(f"no baseline at {base_path}: run with --baseline first for the ratios", flush=True)


if __name__ == "__main__":
    main()
