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
sys.path.insert(0, str(ROOT))  # the hostile catalogue lives with its test
sys.path.insert(0, str(ROOT / "bench"))
import harness
from serve_load import held_out, send

DOCS = harness.RESULTS

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


class Traffic:
    """The soak's workers: good requests (checked against the target alone's answers) and
    hostile ones (checked against their expected status), counted under one lock."""

    def __init__(self, args, url: str, client, model: str, queries, reference: dict) -> None:
        from tests.serve.test_hostile_clients import hostile_requests

        self.args, self.url, self.client, self.model, self.queries, self.reference = args, url, client, model, queries, reference
        self.cases = [*hostile_requests(model), "slow body", "dropped stream"]
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self.diverged: list[dict] = []
        self.lock = threading.Lock()
        self.deadline = time.monotonic() + args.minutes * 60

    def worker(self, seed: int) -> None:
        import httpx

        rng = random.Random(seed)
        with httpx.Client(timeout=120) as http:
            while time.monotonic() < self.deadline:
                if rng.random() < self.args.bad_share:
                    self.hostile(http, rng.choice(self.cases))
                else:
                    self.good(rng.choice(self.queries), rng.random() < ALONE_SHARE)

    def hostile(self, http, case) -> None:
        try:
            problem = hostile(http, self.url, self.model, case)
        except Exception as err:  # noqa: BLE001 (the server must answer every hostile request)
            problem = f"{case if isinstance(case, str) else case[0]}: {type(err).__name__}: {err}"
        with self.lock:
            self.counts["hostile"] += 1
            if problem:
                self.counts["hostile_unexpected"] += 1
                self.problems.append(problem)

    def good(self, q, alone: bool) -> None:
        """``alone``: the target alone in the same traffic (the backend's own batch effects)."""
        r = send(self.client, self.model, q, self.args.max_tokens, {"draft": "none"} if alone else None)
        kind = "alone" if alone else "good"
        with self.lock:
            self.counts[kind] += 1
            self.counts[f"{kind}_tokens"] += r["tokens"]
            if r["error"] is not None:
                self.counts[f"{kind}_failed"] += 1
                self.problems.append(f"{kind} {q.id}: {r['error']}")
            elif r["text"] != self.reference[q.id]:
                self.counts[f"{kind}_diverged"] += 1
                self.diverged.append({"query": q.id, "kind": kind, "text": r["text"]})

    def sample(self, started: float) -> dict:
        import httpx

        metrics = httpx.get(self.url + "/metrics", timeout=30).text
        with self.lock:
            return {"t_s": round(time.monotonic() - started, 1), "rss_bytes": rss_bytes(self.url.process.pid),
                    "metrics_lines": len(metrics.splitlines()), "metrics_bytes": len(metrics), **self.counts,
                    **budget_sample(metrics)}


def reference_answers(client, model: str, queries, max_tokens: int) -> dict:
    """The target alone's answer to each prompt, one at a time, before any learning."""
    reference = {}
    for q in queries:
        r = send(client, model, q, max_tokens, {"draft": "none"})
        assert r["error"] is None, r["error"]
        reference[q.id] = r["text"]
    print(f"{len(reference)} reference answers from the target alone", flush=True)
    return reference


def run_traffic(traffic: Traffic, in_flight: int) -> list[dict]:
    """``in_flight`` workers until the deadline, sampled every 30 s; the samples."""
    started, samples = time.monotonic(), []
    threads = [threading.Thread(target=traffic.worker, args=(i,), daemon=True) for i in range(in_flight)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        samples.append(sample := traffic.sample(started))
        c = traffic.counts
        print(f"[{sample['t_s'] / 60:5.1f} min] rss {sample['rss_bytes'] / 2**20:.0f} MiB, /metrics {sample['metrics_lines']} lines, "
              f"good {c['good']} + alone {c['alone']} (failed {c['good_failed'] + c['alone_failed']}, "
              f"diverged {c['good_diverged']} + {c['alone_diverged']}), hostile {c['hostile']} (unexpected {c['hostile_unexpected']})", flush=True)
        for _ in range(30):  # the next sample in 30 s, or now if the workers are done
            if not any(t.is_alive() for t in threads):
                break
            time.sleep(1.0)
    samples.append(traffic.sample(started))
    return samples


def soak(args) -> dict:
    import httpx

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    queries = held_out(args.prompts)
    server_args = ["--out-dir", str(out / "run"), "--max-batch", str(args.in_flight), "--max-waiting", "64",
                   "--default-max-tokens", str(args.max_tokens), *args.server_args]
    print(f"starting onlinespec serve {' '.join(server_args)}", flush=True)
    with harness.serve_onlinespec(server_args, log_path=out / "server.log") as url:
        client = harness.client(url, 600)
        model = client.models.list().data[0].id
        traffic = Traffic(args, url, client, model, queries, reference_answers(client, model, queries, args.max_tokens))
        samples = run_traffic(traffic, args.in_flight)
        metrics = httpx.get(url + "/metrics", timeout=30).text
        updates = [line for line in metrics.splitlines() if line.startswith(("onlinespec:learner_updates_total", "onlinespec:draft_version_info"))]
    gaps = divergence_gaps(queries, traffic.reference, traffic.diverged)
    return {"server_args": server_args, "minutes": args.minutes, "in_flight": args.in_flight, "bad_share": args.bad_share,
            "max_tokens": args.max_tokens, "prompts": len(queries), "hostile_cases": len(traffic.cases), **dict(traffic.counts),
            "problems": traffic.problems[:50], "divergences": gaps, "divergences_all_near_ties": all(d["gap"] <= d["near_tie"] for d in gaps),
            **memory(samples), "learner_updates": updates, "samples": samples}


def memory(samples: list[dict]) -> dict:
    """Resident memory and /metrics size from warm-up to the end. One sample can land on either
    side of a malloc_trim (swings of ~100 MiB): the medians of the WINDOW_S after warm-up and the
    last WINDOW_S are compared too, which a trend shows and a single swing does not."""
    warm = next((s for s in samples if s["t_s"] >= WARM_S), samples[0])
    last = samples[-1]
    early = [s["rss_bytes"] for s in samples if WARM_S <= s["t_s"] < WARM_S + WINDOW_S]
    late = [s["rss_bytes"] for s in samples if s["t_s"] >= last["t_s"] - WINDOW_S]
    return {"memory_start_bytes": samples[0]["rss_bytes"], "memory_warm_bytes": warm["rss_bytes"],
            "memory_end_bytes": last["rss_bytes"], "memory_growth_after_warm": last["rss_bytes"] / warm["rss_bytes"] - 1,
            "memory_growth_median_windows": statistics.median(late) / statistics.median(early or late) - 1, "memory_window_s": WINDOW_S,
            "memory_peak_bytes": max(s["rss_bytes"] for s in samples),
            # issue 46: every sample from warm-up on within 10% of the warm one; the budget's count under it throughout
            "memory_max_deviation_after_warm": max(abs(s["rss_bytes"] / warm["rss_bytes"] - 1) for s in samples if s["t_s"] >= warm["t_s"]),
            "memory_accounted_peak_bytes": max((sum(s.get("memory_used", {}).values()) for s in samples), default=0),
            "memory_budget_bytes": last.get("memory_budget"), "memory_evictions": last.get("memory_evictions", {}),
            "memory_accounted_under_budget": all(sum(s.get("memory_used", {}).values()) <= s.get("memory_budget", float("inf")) for s in samples),
            "metrics_lines_warm": warm["metrics_lines"], "metrics_lines_end": last["metrics_lines"]}


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
    tokenizer, by_id, runner = target.tokenizer, {q.id: q for q in queries}, target.runner(1)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    gaps: dict[tuple[str, str], float] = {}  # the same answer diverges many times in 30 minutes: measured once
    out = []
    for d in diverged:
        q = by_id[d["query"]]
        if (q.id, d["text"]) not in gaps:
            prompt = encode_prompt(tokenizer, list(q.messages) if q.messages else q.prompt)
            gaps[q.id, d["text"]] = divergence_gap(target, prompt, ids(reference[q.id]), ids(d["text"]), runner)
        out.append({**d, "gap": round(gaps[q.id, d["text"]], 4), "near_tie": tie, "backend": target.backend})
    return out


def plot(summary: dict, path: Path) -> None:
    s = summary["samples"]
    minutes = [x["t_s"] / 60 for x in s]
    fig, axes = harness.figure(1, 3, figsize=(14, 4))
    axes[0].plot(minutes, [x["rss_bytes"] / 2**20 for x in s])
    axes[0].axvline(WARM_S / 60, color="grey", ls=":", label="warm (growth measured from here)")
    windows = summary.get("memory_growth_median_windows")  # older runs did not record it
    axes[0].set(title=f"server memory after warm-up:\nlast sample {summary['memory_growth_after_warm']:+.1%}"
                + (f", window medians {windows:+.1%}" if windows is not None else ""), xlabel="minutes", ylabel="RSS, MiB")
    axes[0].legend(fontsize=8)
    axes[1].plot(minutes, [x["metrics_lines"] for x in s])
    axes[1].set(title="/metrics size", xlabel="minutes", ylabel="lines")
    for key, label in (("good", "good (speculative)"), ("alone", "good (target alone)"), ("hostile", "hostile"),
                       ("good_failed", "good failed"), ("good_diverged", "speculative diverged"), ("alone_diverged", "target alone diverged")):
        axes[2].plot(minutes, [x.get(key, 0) for x in s], label=label)
    axes[2].set(title=f"{summary['in_flight']} in flight, {summary['bad_share']:.0%} hostile", xlabel="minutes", ylabel="requests (cumulative)")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"onlinespec serve soak, {summary['minutes']:.0f} min ({summary['machine']['date']})")
    harness.save(fig, path, dpi=110)


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
        harness.write_result(path, soak(args))
        summary = json.loads(path.read_text())
    plot(summary, path.with_suffix(".png"))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("samples", "machine")}, indent=1))


if __name__ == "__main__":
    main()
