"""Backends side by side: onlinespec on llama.cpp against plain llama.cpp, on the same GGUF file.

On the packaged SmolLM2-135M Q4_1 GGUF and held-out real prompts (the `heldout` split, never seen
in warm-up; chat template applied, the same token ids for every method), greedy, interleaved
prompt by prompt with the order rotated (this machine's speed drifts within an hour):

- `llama.cpp`: llama-cpp-python's own `Llama.create_completion` (what a llama.cpp user runs;
  temperature 0, repeat penalty off), one token per decode;
- `llama.cpp prompt lookup`: the same with its `LlamaPromptLookupDecoding` speculative decoding;
- `ours alone (llama.cpp)`: onlinespec's engine with no draft on the llama.cpp backend;
- `ours default (llama.cpp)`: onlinespec's default speculative decoding (hybrid draft, adaptive k
  on the cost curve measured on llama.cpp) on the llama.cpp backend;
- `ours suffix (llama.cpp)`: the model-free drafters alone (n-gram lookup + suffix index);
- with `--torch`: onlinespec's target alone and default draft on the torch backend (fp32).

Greedy identity is checked against `ours alone` on the same backend (a divergence's top-2 logit
gap is reported), and each method's text against llama.cpp's own.

    python bench/backends.py                  # 60 prompts, 64 new tokens (~15 min on 2 cores)
    python bench/backends.py --n 20 --torch   # with the torch backend beside
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from onlinespec.baselines import PlainLlamaCpp
from onlinespec.benchmark import divergence_gap
from onlinespec.data import read_queries_jsonl
from onlinespec.decoding.runners.llamacpp import cpu_threads
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.factory import engine_options, make_proposer, new_decoder
from onlinespec.models import load_target

RUNS = harness.RUNS / "backends"
DOCS = harness.RESULTS


def llama_cpp_python(gguf: Path, lookup: int | None):
    return PlainLlamaCpp(gguf, lookup).llama


def run_plain(llama, ids: list[int], max_tokens: int) -> tuple[str, int, float]:
    llama.reset()
    start = time.perf_counter()
    out = llama.create_completion(ids, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0, top_k=1)
    seconds = time.perf_counter() - start
    return out["choices"][0]["text"], out["usage"]["completion_tokens"], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lookup", type=int, default=4, help="llama.cpp prompt lookup: tokens drafted per round")
    parser.add_argument("--torch", action="store_true", help="also run the torch backend (fp32)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--head-acceptance", action="store_true",
                        help="instead: the packaged head's acceptance (fixed k) on both backends, same prompts")
    args = parser.parse_args()
    if args.head_acceptance:
        return head_acceptance(args)
    RUNS.mkdir(parents=True, exist_ok=True)
    out = RUNS / "backends.json"
    if not args.report_only:
        prompts = RUNS / "heldout.jsonl"
        subprocess.run([sys.executable, "-m", "onlinespec.cli", "data", "export", "--n", str(args.n), "--out", str(prompts),
                        "--split", "heldout"], check=True)
        harness.write_result(out, measure(read_queries_jsonl(prompts), args))
    write_report(json.loads(out.read_text()))


def measure(queries, args) -> dict:
    target = load_target("default", backend="llama.cpp")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    ours = {
        "ours alone (llama.cpp)": new_decoder(target, None, 0),
        "ours default (llama.cpp)": new_decoder(target, make_proposer("hybrid", target).proposer, 4,
                                                engine_options(target, 4, adaptive=True)),
        "ours suffix (llama.cpp)": new_decoder(target, make_proposer("suffix", target).proposer, 4,
                                               engine_options(target, 4, adaptive=True)),
    }
    if args.torch:
        torch_target = load_target("default", backend="torch", device="cpu")
        ours["ours alone (torch)"] = new_decoder(torch_target, None, 0)
        ours["ours default (torch)"] = new_decoder(torch_target, make_proposer("hybrid", torch_target).proposer, 4,
                                                   engine_options(torch_target, 4, adaptive=True))
    plain = {"llama.cpp": llama_cpp_python(target.gguf, None), "llama.cpp prompt lookup": llama_cpp_python(target.gguf, args.lookup)}
    methods = list(plain) + list(ours)
    encode = ours["ours alone (llama.cpp)"].encode
    prompts = [encode(list(q.messages) if q.messages else q.prompt) for q in queries]
    for ids in prompts[:2]:  # warm-up
        for llama in plain.values():
            run_plain(llama, ids, 8)
        for decoder in ours.values():
            decoder.generate(ids, SamplingParams(max_new_tokens=8))
    targets = {m: torch_target if "torch" in m else target for m in ours} if args.torch else dict.fromkeys(ours, target)
    rows = []
    for i, ids in enumerate(prompts):
        rows.append(prompt_row(queries[i], ids, i, plain, ours, targets, params, args.max_new_tokens))
        print(f"[{i + 1}/{len(prompts)}] " + "  ".join(f"{m}: {rows[-1][m]['tokens'] / rows[-1][m]['seconds']:.0f}" for m in methods), flush=True)
    curve = ours["ours default (llama.cpp)"].adaptive_k.curve
    return {"machine": harness.machine(), "n_prompts": len(rows), "max_new_tokens": args.max_new_tokens, "threads": cpu_threads(),
            "summary": summarize(rows, methods, ours), "rows": rows, "cost_curve_ms": curve.milliseconds()}


def prompt_row(query, ids: list[int], i: int, plain: dict, ours: dict, targets: dict, params, max_new_tokens: int) -> dict:
    """Every method on one prompt, the order rotated by ``i``; each of ours checked against its backend's target alone."""
    row = {"id": query.id, "domain": query.domain, "prompt_tokens": len(ids)}
    for method in harness.rotated([*plain, *ours], i):
        if method in plain:
            text, tokens, seconds = run_plain(plain[method], ids, max_new_tokens)
            row[method] = {"tokens": tokens, "seconds": seconds, "text": text}
        else:
            g = ours[method].generate(ids, params)
            row[method] = {"tokens": len(g.token_ids), "seconds": g.stats.seconds, "text": g.text, "ids": g.token_ids,
                           "acceptance": g.stats.acceptance_rate, "proposed": g.stats.proposed}
    for method in ours:
        base = "ours alone (torch)" if "torch" in method else "ours alone (llama.cpp)"
        same = row[method]["ids"] == row[base]["ids"]
        row[method]["identical"] = same
        if not same:
            row[method]["gap"] = divergence_gap(targets[method], ids, row[base]["ids"], row[method]["ids"])
    return row


def summarize(rows: list[dict], methods: list[str], ours: dict) -> dict:
    summary = {}
    for method in methods:
        tokens = sum(r[method]["tokens"] for r in rows)
        seconds = sum(r[method]["seconds"] for r in rows)
        ratios = [r[method]["tokens"] / r[method]["seconds"] / (r["llama.cpp"]["tokens"] / r["llama.cpp"]["seconds"]) for r in rows]
        entry = {"tokens_per_s": tokens / seconds, "median_ratio_vs_llama_cpp": statistics.median(ratios),
                 "same_text_as_llama_cpp": sum(r[method]["text"] == r["llama.cpp"]["text"] for r in rows)}
        if method in ours:
            entry["identical_to_alone"] = sum(r[method]["identical"] for r in rows)
            entry["divergence_gaps"] = [r[method]["gap"] for r in rows if "gap" in r[method]]
            entry["proposed_per_token"] = sum(r[method]["proposed"] for r in rows) / tokens
        summary[method] = entry
    base = summary["llama.cpp"]["tokens_per_s"]
    for entry in summary.values():
        entry["ratio_vs_llama_cpp"] = entry["tokens_per_s"] / base
    return summary


def head_acceptance(args) -> None:
    """The packaged head alone, fixed k = 2, greedy, on each backend: what verification accepted
    (alpha, and the first proposal's acceptance). The features it reads come from each backend's
    own forward: llama.cpp's Q4_1 kernels against the dequantised weights in fp32."""
    prompts = RUNS / "heldout.jsonl"
    subprocess.run([sys.executable, "-m", "onlinespec.cli", "data", "export", "--n", str(args.n), "--out", str(prompts),
                    "--split", "heldout"], check=True)
    queries = read_queries_jsonl(prompts)
    out = {"n_prompts": len(queries)}
    for backend in ("llama.cpp", "torch"):
        target = load_target("default", backend=backend, device="cpu")
        decoder = new_decoder(target, make_proposer("head", target).proposer, 2, trace_top_k=1)
        proposed = accepted = first = rounds = 0
        for q in queries:
            g = decoder.generate(list(q.messages) if q.messages else q.prompt, SamplingParams(max_new_tokens=args.max_new_tokens), trace=True)
            for t in g.trace:
                if t.proposals:
                    rounds += 1
                    proposed += len(t.proposals)
                    accepted += t.n_accepted
                    first += t.n_accepted > 0
        out[backend] = {"alpha": accepted / proposed, "first_proposal_accepted": first / rounds, "rounds": rounds}
        print(backend, out[backend], flush=True)
    out["alpha_difference"] = out["llama.cpp"]["alpha"] - out["torch"]["alpha"]
    harness.write_result(DOCS / "backends-head-acceptance.json", out)


def write_report(result: dict) -> None:
    summary = result["summary"]
    lines = [
        "| method | tokens/s | / llama.cpp (pooled) | median per prompt | same text as llama.cpp | identical to ours alone (same backend) | divergence gaps |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, e in summary.items():
        ident = f"{e['identical_to_alone']}/{result['n_prompts']}" if "identical_to_alone" in e else ""
        gaps = ", ".join(f"{g:.3f}" for g in e.get("divergence_gaps", []))
        lines.append(f"| {method} | {e['tokens_per_s']:.1f} | {e['ratio_vs_llama_cpp']:.3f}x | {e['median_ratio_vs_llama_cpp']:.3f}x | "
                     f"{e['same_text_as_llama_cpp']}/{result['n_prompts']} | {ident} | {gaps} |")
    table = "\n".join(lines)
    (RUNS / "table.md").write_text(table + "\n")
    print(table)
    fig, ax = harness.figure(figsize=(9, 4))
    names = list(summary)
    ax.barh(names, [summary[m]["tokens_per_s"] for m in names], color=["#777" if "ours" not in m else "#1f77b4" for m in names])
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (pooled over prompts, greedy, batch 1)")
    ax.set_title(f"SmolLM2-135M Q4_1 GGUF, {result['n_prompts']} held-out prompts, {result['machine']['date']}")
    harness.save(fig, DOCS / "backends.png")


if __name__ == "__main__":
    main()
