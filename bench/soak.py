"""A soak of `onlinespec serve` (the packaged default target and draft, learning on): mixed good
and hostile traffic at a fixed number in flight for a fixed time, all on 127.0.0.1.

Every good request is greedy and streamed through the real `openai` client, and its text must
equal the target alone's for the same prompt (served by the same server with `"draft": "none"`,
before the soak starts). Hostile requests are tests/serve/test_hostile_clients.py's catalogue
(bad token ids, deep JSON, huge stop lists, invalid UTF-8, vLLM extras, bad domains, ...) plus
slow bodies and streams dropped after their first token; each must get its expected status.
A sampler records the server's resident memory and the size of /metrics every 30 s.

    python bench/soak.py                         # 30 minutes at 8 in flight (~35 min with start-up)
    python bench/soak.py --minutes 2             # a quick look
    python bench/soak.py --report-only           # rewrite docs/results/soak.png from docs/results/soak.json
    python bench/soak.py --minutes 12 --json docs/results/soak-static.json --server-args --static   # learning off: what memory does then

Writes docs/results/soak.json and docs/results/soak.png; docs/reliability.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "results"
sys.path.insert(0, str(ROOT))  # the hostile catalogue lives with its test
sys.path.insert(0, str(ROOT / "bench"))

ALONE_SHARE = 0.25  # of the good requests, those served by the target alone ("draft": "none")
WARM_S = 300.0  # memory growth is measured from here on (models loaded, caches and buffers filled)
WINDOW_S = 180.0  # the windows whose median RSS is compared: the first after warm-up, the last


def rss_bytes(pid: int) -> int:
    """The server's resident memory, its child processes included."""
    import psutil

    process = psutil.Process(pid)
    return process.memory_info().rss + sum(c.memory_info().rss for c in process.children(recursive=True))


def budget_sample(metrics: str) -> dict:
    """The memory budget's gauges in a /metrics text (issue 46): the budget, the bytes held by kind
    and the evictions by kind (empty before the server had them)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {"memory_used": {}, "memory_evictions": {}}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "onlinespec:memory_budget_bytes":
                found["memory_budget"] = sample.value
            elif sample.name == "onlinespec:memory_used_bytes":
                found["memory_used"][sample.labels["kind"]] = sample.value
            elif sample.name == "onlinespec:memory_evictions_total":
                found["memory_evictions"][sample.labels["kind"]] = sample.value
    return found


def hostile(http, url: str, model: str, case) -> str | None:
    """Send one hostile case; None if the server answered as expected, else what went wrong."""
    from tests.serve.test_hostile_clients import dropped_stream, slow_body

    if case == "slow body":
        host, port = url.removeprefix("http://").split(":")
        slow_body(host, int(port), 2.0)
        return None
    if case == "dropped stream":
        dropped_stream(url, model)
        return None
    name, path, body, status, where = case
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = http.post(url + path, headers={"content-type": "application/json"}, **kwargs)
    if response.status_code != status:
        return f"{name}: {response.status_code} (expected {status}) {response.text[:200]}"
    error = response.json().get("error", {})
    return None if where in (error.get("param"), error.get("code")) else f"{name}: {error}"


def soak(args) -> dict:
    import httpx
    import openai

    from onlinespec.benchmark import machine_info
    from onlinespec.serve.server import ServerProcess
    from serve_load import held_out, send
    from tests.serve.test_hostile_clients import hostile_requests

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    queries = held_out(args.prompts)
    server_args = ["--out-dir", str(out / "run"), "--max-batch", str(args.in_flight), "--max-waiting", "64",
                   "--default-max-tokens", str(args.max_tokens), *args.server_args]
    print(f"starting onlinespec serve {' '.join(server_args)}", flush=True)
    with ServerProcess(server_args, log=out / "server.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        reference = {}
        for q in queries:  # the target alone, one at a time, before any learning
            r = send(client, model, q, args.max_tokens, {"draft": "none"})
            assert r["error"] is None, r["error"]
            reference[q.id] = r["text"]
        print(f"{len(reference)} reference answers from the target alone", flush=True)
        cases = [*hostile_requests(model), "slow body", "dropped stream"]
        counts: Counter = Counter()
        problems: list[str] = []
        diverged: list[dict] = []
        samples: list[dict] = []
        lock = threading.Lock()
        started = time.monotonic()
        deadline = started + args.minutes * 60

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(timeout=120) as http:
                while time.monotonic() < deadline:
                    if rng.random() < args.bad_share:
                        case = rng.choice(cases)
                        try:
                            problem = hostile(http, server.url, model, case)
                        except Exception as err:  # the server must answer every hostile request
                            problem = f"{case if isinstance(case, str) else case[0]}: {type(err).__name__}: {err}"
                        with lock:
                            counts["hostile"] += 1
                            if problem:
                                counts["hostile_unexpected"] += 1
                                problems.append(problem)
                        continue
                    q = rng.choice(queries)
                    alone = rng.random() < ALONE_SHARE  # the target alone in the same traffic: the backend's own batch effects
                    r = send(client, model, q, args.max_tokens, {"draft": "none"} if alone else None)
                    kind = "alone" if alone else "good"
                    with lock:
                        counts[kind] += 1
                        counts[f"{kind}_tokens"] += r["tokens"]
                        if r["error"] is not None:
                            counts[f"{kind}_failed"] += 1
                            problems.append(f"{kind} {q.id}: {r['error']}")
                        elif r["text"] != reference[q.id]:
                            counts[f"{kind}_diverged"] += 1
                            diverged.append({"query": q.id, "kind": kind, "text": r["text"]})

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.in_flight)]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            metrics = httpx.get(server.url + "/metrics", timeout=30).text
            with lock:
                sample = {"t_s": round(time.monotonic() - started, 1), "rss_bytes": rss_bytes(server.process.pid),
                          "metrics_lines": len(metrics.splitlines()), "metrics_bytes": len(metrics), **counts,
                          **budget_sample(metrics)}
            samples.append(sample)
            print(f"[{sample['t_s'] / 60:5.1f} min] rss {sample['rss_bytes'] / 2**20:.0f} MiB, /metrics {sample['metrics_lines']} lines, "
                  f"good {counts['good']} + alone {counts['alone']} (failed {counts['good_failed'] + counts['alone_failed']}, "
                  f"diverged {counts['good_diverged']} + {counts['alone_diverged']}), "
                  f"hostile {counts['hostile']} (unexpected {counts['hostile_unexpected']})", flush=True)
            for _ in range(30):  # the next sample in 30 s, or now if the workers are done
                if not any(t.is_alive() for t in threads):
                    break
                time.sleep(1.0)
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        samples.append({"t_s": round(time.monotonic() - started, 1), "rss_bytes": rss_bytes(server.process.pid),
                        "metrics_lines": len(metrics.splitlines()), "metrics_bytes": len(metrics), **counts,
                        **budget_sample(metrics)})
        updates = [line for line in metrics.splitlines() if line.startswith(("onlinespec:learner_updates_total", "onlinespec:draft_version_info"))]
    gaps = divergence_gaps(queries, reference, diverged)
    warm = next((s for s in samples if s["t_s"] >= WARM_S), samples[0])
    last = samples[-1]
    # One sample can land on either side of a malloc_trim (swings of ~100 MiB): also compare the medians of
    # the WINDOW_S after warm-up and the last WINDOW_S, which a trend shows and a single swing does not.
    early = [s["rss_bytes"] for s in samples if WARM_S <= s["t_s"] < WARM_S + WINDOW_S]
    late = [s["rss_bytes"] for s in samples if s["t_s"] >= last["t_s"] - WINDOW_S]
    return {
        "command": " ".join(["python", *sys.argv]), "machine": machine_info(), "server_args": server_args,
        "minutes": args.minutes, "in_flight": args.in_flight, "bad_share": args.bad_share, "max_tokens": args.max_tokens,
        "prompts": len(queries), "hostile_cases": len(cases), **dict(counts),
        "problems": problems[:50], "divergences": gaps,
        "divergences_all_near_ties": all(d["gap"] <= d["near_tie"] for d in gaps), "memory_start_bytes": samples[0]["rss_bytes"], "memory_warm_bytes": warm["rss_bytes"],
        "memory_end_bytes": last["rss_bytes"], "memory_growth_after_warm": last["rss_bytes"] / warm["rss_bytes"] - 1,
        "memory_growth_median_windows": statistics.median(late) / statistics.median(early or late) - 1, "memory_window_s": WINDOW_S,
        "memory_peak_bytes": max(s["rss_bytes"] for s in samples),
        # issue 46: every sample from warm-up on within 10% of the warm one; the budget's count under it throughout
        "memory_max_deviation_after_warm": max(abs(s["rss_bytes"] / warm["rss_bytes"] - 1) for s in samples if s["t_s"] >= warm["t_s"]),
        "memory_accounted_peak_bytes": max((sum(s.get("memory_used", {}).values()) for s in samples), default=0),
        "memory_budget_bytes": last.get("memory_budget"), "memory_evictions": last.get("memory_evictions", {}),
        "memory_accounted_under_budget": all(sum(s.get("memory_used", {}).values()) <= s.get("memory_budget", float("inf")) for s in samples),
        "metrics_lines_warm": warm["metrics_lines"], "metrics_lines_end": last["metrics_lines"], "learner_updates": updates,
        "samples": samples,
    }


def divergence_gaps(queries, reference: dict, diverged: list[dict]) -> list[dict]:
    """Where each good answer that differs from the batch-of-one reference first differs: the
    gap between the target's two best logits there (its own backend, one forward alone). A
    near-tie (``NEAR_TIE``) is the backend's arithmetic, not a wrong answer."""
    if not diverged:
        return []
    from onlinespec.benchmark import NEAR_TIE, divergence_gap
    from onlinespec.models import load_target
    from onlinespec.tokens import encode_prompt

    target = load_target("default", backend="auto", device="cpu")
    tie = NEAR_TIE["gguf"] if target.backend == "llama.cpp" else NEAR_TIE["float32"]
    tokenizer, by_id = target.tokenizer, {q.id: q for q in queries}
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    out = []
    for d in diverged:
        q = by_id[d["query"]]
        prompt = encode_prompt(tokenizer, list(q.messages) if q.messages else q.prompt)
        gap = divergence_gap(target, prompt, ids(reference[q.id]), ids(d["text"]))
        out.append({**d, "gap": round(gap, 4), "near_tie": tie, "backend": target.backend})
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary["samples"]
    minutes = [x["t_s"] / 60 for x in s]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(minutes, [x["rss_bytes"] / 2**20 for x in s])
    axes[0].axvline(WARM_S / 60, color="grey", ls=":", label="warm (growth measured from here)")
    axes[0].set(title=f"server memory after warm-up:\nlast sample {summary['memory_growth_after_warm']:+.1%}, window medians {summary['memory_growth_median_windows']:+.1%}", xlabel="minutes", ylabel="RSS, MiB")
    axes[0].legend(fontsize=8)
    axes[1].plot(minutes, [x["metrics_lines"] for x in s])
    axes[1].set(title="/metrics size", xlabel="minutes", ylabel="lines")
    for key, label in (("good", "good (speculative)"), ("alone", "good (target alone)"), ("hostile", "hostile"),
                       ("good_failed", "good failed"), ("good_diverged", "speculative diverged"), ("alone_diverged", "target alone diverged")):
        axes[2].plot(minutes, [x.get(key, 0) for x in s], label=label)
    axes[2].set(title=f"{summary['in_flight']} in flight, {summary['bad_share']:.0%} hostile", xlabel="minutes", ylabel="requests (cumulative)")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"onlinespec serve soak, {summary['minutes']:.0f} min ({summary['machine']['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--bad-share", type=float, default=0.3, help="share of requests that are hostile")
    parser.add_argument("--prompts", type=int, default=24, help="distinct good prompts (each checked against the target alone)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--json", default=str(DOCS / "soak.json"), help="where the summary goes (its plot beside it, .png)")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `onlinespec serve` flags (e.g. --static)")
    args = parser.parse_args()
    path = Path(args.json)
    if args.report_only:
        summary = json.loads(path.read_text())
    else:
        summary = soak(args)
        path.write_text(json.dumps(summary, indent=1))
    plot(summary, path.with_suffix(".png"))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("samples", "machine")}, indent=1))


if __name__ == "__main__":
    main()
