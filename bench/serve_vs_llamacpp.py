"""Serving at several requests in flight: `onlinespec serve` against llama.cpp's own servers, on
the same GGUF file and the same held-out requests, through the real `openai` client on 127.0.0.1.

- `onlinespec`: `onlinespec serve` on the packaged default (the llama.cpp backend, the default
  hybrid draft kept static, batched engine with --max-batch at the highest level);
- `onlinespec alone`: the same server with `--draft none` (the target alone, batched);
- `llama-server`: llama.cpp's C++ server (`make llama-server`) with `--parallel` at the highest
  level, continuous batching, 4096 tokens of context per slot, 2 threads (issue 51's baseline);
- `llama_cpp.server`: `python -m llama_cpp.server` on the same GGUF, 2 threads, n_ctx 4096,
  `--interrupt_requests False` (its default cancels the request in flight when another arrives).
  It serves one request at a time (its settings have no parallel slots); repeat penalty off so it
  computes what the others do. Needs `pip install 'llama-cpp-python[server]'`.

Streamed, greedy, 48 new tokens at most. Each level sends its own ``--n`` requests (the same to
every server), and each of ``--rounds`` rounds new ones, so no server sees a prompt twice. Every
server is started first and stays up; each level then runs on every server in turn, the server
that goes first rotating with the level (`harness.interleave`), so that the machine's drift falls
on all alike. Tokens are counted the same way for every server, by tokenizing the text it streamed
with the target's tokenizer.

    python bench/serve_vs_llamacpp.py --n 48 --levels 1,4,8
    python bench/serve_vs_llamacpp.py --servers onlinespec,llama-server --levels 1,4,8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from serve_load import held_out, run_level, send

DOCS = harness.RESULTS
BASELINES = ("llama-server", "llama_cpp.server")  # the first measured is the ratios' denominator


def start(name: str, stack: contextlib.ExitStack, work: Path, max_batch: int, n: int, max_tokens: int) -> str:
    """Start one server for the rest of the run; its base URL."""
    from onlinespec.decoding.runners.llamacpp import cpu_threads
    from onlinespec.models import default_gguf_path

    log = work / f"{name.replace(' ', '-')}.log"
    if name == "llama-server":
        return stack.enter_context(harness.serve_llama_server(default_gguf_path(), parallel=max_batch, threads=cpu_threads(), log_path=log))
    if name == "llama_cpp.server":
        port = harness.free_port()
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_gguf_path()), "--host", "127.0.0.1",
                   "--port", str(port), "--n_threads", str(cpu_threads()), "--n_threads_batch", str(cpu_threads()),
                   "--n_ctx", "4096", "--n_batch", "512",
                   # its default (True) cancels the request in flight whenever a new one arrives:
                   # at 4 in flight every stream but the last came back empty, with status 200
                   "--interrupt_requests", "False"]
        return stack.enter_context(harness.serve_command(command, f"http://127.0.0.1:{port}", "/v1/models", log, 900))
    extra = ["--static"] if name == "onlinespec" else ["--draft", "none"]
    args = [*extra, "--out-dir", str(work / name), "--max-batch", str(max_batch), "--max-waiting", str(n), "--default-max-tokens", str(max_tokens)]
    return stack.enter_context(harness.serve_onlinespec(args, log_path=log))


def measure(names: list[str], levels: list[int], queries, warm_up, args) -> dict:
    """Each level on every server, interleaved, ``args.rounds`` times; figures by server, then level
    (:func:`merged` over the rounds). ``queries[r][n]`` are round ``r``'s requests at level ``n``,
    ``warm_up`` a few others."""
    runs: dict = {name: {n: [] for n in levels} for name in names}
    with contextlib.ExitStack() as stack:
        urls = {name: start(name, stack, args.work, max(levels), args.n, args.max_tokens) for name in names}
        clients = {name: harness.client(url) for name, url in urls.items()}
        models = {name: c.models.list().data[0].id for name, c in clients.items()}
        extras = {name: {"repeat_penalty": 1.0} if name in BASELINES else None for name in names}  # what the others compute
        for name in names:
            for q in warm_up:
                send(clients[name], models[name], q, 8, extras[name])
        for r in range(args.rounds):
            for n, name in harness.interleave(levels, harness.rotated(names, r)):
                f = run_level(clients[name], models[name], queries[r][n], args.max_tokens, n, extras[name])
                runs[name][n].append(f)
                print(f"[{name}] round {r + 1}, {n} in flight: {f['tokens_per_s']:.1f} tok/s, p50 {f['latency_p50_s']:.2f} s, "
                      f"TTFT p50 {f['ttft_p50_s']:.3f} s, errors {f['errors']}", flush=True)
    return {name: {n: merged(rs) for n, rs in levels_runs.items()} for name, levels_runs in runs.items()}


def merged(rounds: list[dict]) -> dict:
    """One level's rounds as one: counts and walls summed (tokens/s over all of them), each
    percentile the median of the rounds', every round's own figures kept under "rounds"."""
    total = {key: sum(r[key] for r in rounds) for key in ("requests", "errors", "wall_s", "tokens")}
    total.update(tokens_per_s=total["tokens"] / total["wall_s"], requests_per_s=(total["requests"] - total["errors"]) / total["wall_s"],
                 error_examples=[e for r in rounds for e in r["error_examples"]][:3],
                 texts={k: v for r in rounds for k, v in r["texts"].items()})
    for key in ("latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s"):
        total[key] = statistics.median(r[key] for r in rounds)
    total["rounds"] = [{k: v for k, v in r.items() if k != "texts"} for r in rounds]
    return total


def compare(servers: dict, work: Path, stem: str) -> None:
    """Tokens by the target's tokenizer, ratios against the baseline server, identical texts."""
    from transformers import AutoTokenizer

    from onlinespec.models import default_target_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_target_dir()))
    texts = {name: {n: f.pop("texts") for n, f in figures.items()} for name, figures in servers.items()}
    (work / f"{stem}-texts.json").write_text(json.dumps(texts))
    for name, figures in servers.items():
        for n, f in figures.items():
            f["tokens_retokenized"] = sum(len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts[name][n].values())
            f["tokens_per_s_retokenized"] = f["tokens_retokenized"] / f["wall_s"]
    for name, figures in servers.items():
        for n, f in figures.items():
            for baseline in BASELINES:
                base = servers.get(baseline, {}).get(n)
                f[f"ratio_vs_{baseline.replace('.', '_').replace('-', '_')}"] = f["tokens_per_s_retokenized"] / base["tokens_per_s_retokenized"] if base else None
        same = texts.get("onlinespec alone", {})
        if name != "onlinespec alone" and same:
            for n in figures:
                figures[n]["same_text_as_onlinespec_alone"] = sum(texts[name][n][k] == same[n].get(k) for k in texts[name][n])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=1, help="times every level runs on every server, each with new requests")
    parser.add_argument("--servers", default="onlinespec,llama-server,llama_cpp.server,onlinespec alone",
                        help="comma-separated, of: onlinespec, onlinespec alone, llama-server, llama_cpp.server")
    parser.add_argument("--work", type=Path, default=harness.RUNS / "serve-vs-llamacpp")
    parser.add_argument("--out", type=Path, default=DOCS / "serve-vs-llamacpp.json")
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    # each level its own requests, and the warm-up others: no server is sent a prompt twice, so no
    # prompt cache serves a level from an earlier one (llama-server keeps finished prompts' states
    # in RAM, --cache-ram, 8 GiB by default: in the 2026-12-06 run it answered the later levels'
    # prompts from the first level's, one token of prefill each)
    pool = held_out(args.n * len(levels) * args.rounds + 3)
    chunks = iter(pool[i: i + args.n] for i in range(0, args.n * len(levels) * args.rounds, args.n))
    queries = [{n: next(chunks) for n in levels} for _ in range(args.rounds)]
    servers = measure(args.servers.split(","), levels, queries, pool[-3:], args)
    compare(servers, args.work, args.out.stem)
    harness.write_result(args.out, {"n_requests": args.n, "rounds": args.rounds, "max_tokens": args.max_tokens,
                                    "requests": "different at each level and round",
                                    "order": "interleaved by level (harness.interleave), the first server rotating by round",
                                    "servers": servers})
    for name, figures in servers.items():
        print(name, {n: (round(f["tokens_per_s_retokenized"], 1), f["ratio_vs_llama_server"], f["ratio_vs_llama_cpp_server"]) for n, f in figures.items()})


if __name__ == "__main__":
    main()
