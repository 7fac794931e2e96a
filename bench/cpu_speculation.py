"""Does speculation pay on this CPU? onlinespec on the shipped and converted weights against plain llama.cpp.

On held-out packaged prompts (the `heldout` split: 20 chat, 20 code, 20 maths by default), and
optionally standard-library documentation to summarise and standard-library functions to edit
(`--edits`: return the code with one name changed, answers that quote their prompt), greedy,
batch 1, interleaved prompt by prompt with the order rotated (this machine's speed drifts):

- `llama.cpp Q4_1`: llama-cpp-python's own generation on the shipped file (what a user runs);
- `llama.cpp <fmt>`: the same on the converted file (the same-file baseline);
  `auto:<fmt>` is the format ``--target-format auto`` (serve's default) chose on this machine;
- `alone <fmt>` / `default <fmt>` / `lookup <fmt>`: onlinespec's engine with no draft, with the
  default hybrid draft (lookups, suffix index, the head where they find nothing), and with the
  model-free drafters alone, with adaptive k on the curve measured on that file.

Greedy identity is checked against `alone` on the same file (a divergence's top-2 logit gap is
reported). Ratios are pooled tokens/s and per domain, against `llama.cpp Q4_1`.

    python bench/cpu_speculation.py                        # 60 prompts, the default path (--target-format auto) (~10 min)
    python bench/cpu_speculation.py --formats as-is,q8_0   # the shipped file and its Q8_0 copy
    python bench/cpu_speculation.py --formats as-is,q8_0,f16 --summaries 20
    python bench/cpu_speculation.py --formats as-is --edits 20       # where acceptance is high
    python bench/cpu_speculation.py --target ~/.cache/onlinespec/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --formats as-is --n 60 --domains code      # the 1.5B on 20 code prompts (issue 45)

On another target than the packaged one, the file as given is labelled `shipped` (`llama.cpp shipped`).
"""

from __future__ import annotations

import argparse
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
from onlinespec.data.sources import MissingDataError, edit_prompts, long_prompts
from onlinespec.decoding.runners.llamacpp import cpu_threads
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.factory import engine_options, make_proposer, new_decoder
from onlinespec.models import load_target

RUNS = harness.RUNS / "cpu_speculation"
RESULTS = harness.RESULTS
BASE = "llama.cpp Q4_1"  # the packaged target's; another target's file as given is "shipped" (set in main)


def queries(args):
    prompts = RUNS / "heldout.jsonl"
    subprocess.run([sys.executable, "-m", "onlinespec.cli", "data", "export", "--n", str(args.n), "--out", str(prompts),
                    "--split", "heldout"], check=True)
    found = read_queries_jsonl(prompts)
    if args.domains:
        found = [q for q in found if q.domain in args.domains.split(",")]
    if args.summaries:  # as many as the standard library offers, up to the number asked
        docs = next(p for n in range(2 * args.summaries, 0, -1) if (p := _long_prompts(n)) is not None)
        found += [q for q in docs if q.domain == "docs"][: args.summaries]
    if args.edits:
        found += edit_prompts(args.edits)
    return found


def _long_prompts(n: int):
    try:
        return long_prompts(n)
    except MissingDataError:
        return None


def methods(spec: str, fmt: str, proposers: list[str]):
    """(label, decoder or llama) per method on one weight format."""
    target = load_target(spec, backend="llama.cpp", target_format=fmt)
    converted = target.gguf != target.gguf_source
    tag = Path(target.gguf).suffixes[-2][1:] if converted else BASE.split(" ", 1)[1]  # q8_0 from <file>.q8_0.gguf
    if fmt == "auto":  # the format this machine chose for the file (onlinespec convert --format auto, as make setup runs it)
        tag = f"auto:{tag}"
    found = {f"alone {tag}": new_decoder(target, None, 0)}
    for name in proposers:
        proposer = make_proposer(name, target).proposer
        label = {"hybrid": "default", "suffix": "lookup"}.get(name, name)
        found[f"{label} {tag}"] = new_decoder(target, proposer, 4, engine_options(target, 4, adaptive=True))
    if converted:  # the same-file baseline
        found[f"llama.cpp {tag}"] = PlainLlamaCpp(target.gguf)
    return target, found


def run_one(method, runner, ids, tokens):
    if isinstance(runner, PlainLlamaCpp):
        out, seconds = runner.generate(ids, SamplingParams(max_new_tokens=tokens))
        return {"tokens": len(out), "seconds": seconds, "ids": out}
    g = runner.generate(ids, SamplingParams(max_new_tokens=tokens))
    return {"tokens": len(g.token_ids), "seconds": g.stats.seconds, "text": g.text, "ids": g.token_ids,
            "acceptance": g.stats.acceptance_rate, "proposed": g.stats.proposed}


def measure(found_queries, args) -> dict:
    runners, targets = {}, {}
    for fmt in args.formats.split(","):
        target, found = methods(args.target, fmt, args.proposers.split(","))
        targets.update({m: target for m in found})
        runners.update(found)
    runners = {BASE: PlainLlamaCpp(next(iter(targets.values())).gguf_source), **runners}  # the file as shipped
    encode = next(r for r in runners.values() if hasattr(r, "encode")).encode
    prompts = [encode(list(q.messages) if q.messages else q.prompt) for q in found_queries]
    for ids in prompts[:2]:  # warm-up
        for method, runner in runners.items():
            run_one(method, runner, ids, 8)
    names, rows = list(runners), []
    for i, ids in enumerate(prompts):
        q = found_queries[i]
        row = {"id": q.id, "domain": q.domain, "prompt_tokens": len(ids)}
        for method in harness.rotated(names, i):
            row[method] = run_one(method, runners[method], ids, args.max_new_tokens)
        for method in names:
            if "acceptance" in row[method] and not method.startswith("alone"):  # a draft's output against its own file's target alone
                alone = f"alone {method.split(' ', 1)[1]}"
                row[method]["identical"] = row[method]["ids"] == row[alone]["ids"]
                if not row[method]["identical"]:
                    row[method]["gap"] = divergence_gap(targets[method], ids, row[alone]["ids"], row[method]["ids"])
        rows.append(row)
        print(f"[{i + 1}/{len(prompts)}] {q.domain:5} " + "  ".join(f"{m}: {row[m]['tokens'] / row[m]['seconds']:.0f}" for m in names), flush=True)
    return {"machine": harness.machine(), "target": Path(str(args.target)).name, "threads": cpu_threads(),
            "max_new_tokens": args.max_new_tokens, "n_prompts": len(rows),
            "target_files": {m: str(t.gguf) for m, t in targets.items()}, "summary": summarize(rows, names), "rows": rows}


def summarize(rows, names) -> dict:
    def rate(subset, method):
        return sum(r[method]["tokens"] for r in subset) / sum(r[method]["seconds"] for r in subset)

    domains = sorted({r["domain"] for r in rows})
    summary = {}
    for method in names:
        entry = {"tokens_per_s": rate(rows, method), "ratio": rate(rows, method) / rate(rows, BASE),
                 "median_ratio": statistics.median(r[method]["tokens"] / r[method]["seconds"] / (r[BASE]["tokens"] / r[BASE]["seconds"]) for r in rows),
                 "by_domain": {d: rate([r for r in rows if r["domain"] == d], method) / rate([r for r in rows if r["domain"] == d], BASE) for d in domains}}
        if "identical" in rows[0][method]:
            entry["identical_to_alone"] = sum(r[method]["identical"] for r in rows)
            entry["divergence_gaps"] = [round(r[method]["gap"], 4) for r in rows if "gap" in r[method]]
        if "acceptance" in rows[0][method]:
            entry["acceptance"] = {d: statistics.mean(r[method]["acceptance"] for r in rows if r["domain"] == d) for d in domains}
            entry["proposed_per_token"] = sum(r[method]["proposed"] for r in rows) / sum(r[method]["tokens"] for r in rows)
        summary[method] = entry
    return summary


def report(result: dict) -> str:
    domains = list(next(iter(result["summary"].values()))["by_domain"])
    lines = [f"| method | tokens/s | / {BASE} | median per prompt | " + " | ".join(domains) + " | identical to alone |",
             "|---|---|---|---|" + "---|" * len(domains) + "---|"]
    for method, e in result["summary"].items():
        ident = f"{e['identical_to_alone']}/{result['n_prompts']}" if "identical_to_alone" in e else ""
        lines.append(f"| {method} | {e['tokens_per_s']:.1f} | {e['ratio']:.3f}x | {e['median_ratio']:.3f}x | "
                     + " | ".join(f"{e['by_domain'][d]:.3f}x" for d in domains) + f" | {ident} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    summary = result["summary"]
    domains = list(next(iter(summary.values()))["by_domain"])
    names = [m for m in summary if m != BASE]
    harness.plot_bars(path, domains, {m: [summary[m]["by_domain"][d] for d in domains] for m in names}, hline=1.0, figsize=(10, 4.5),
                      title=f"{result['target']}, batch 1, greedy, {result['max_new_tokens']} tokens, {result['machine']['date']}",
                      ylabel=f"tokens/s / {BASE} (plain llama.cpp, shipped file)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=60, help="held-out packaged prompts (chat, code, maths in turn)")
    parser.add_argument("--summaries", type=int, default=0, help="also this many documentation-summary prompts (domain docs)")
    parser.add_argument("--edits", type=int, default=0, help="also this many code-editing prompts (domain edit)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--target", default="default", help="a GGUF file (default: the packaged SmolLM2-135M)")
    parser.add_argument("--domains", default="", help="keep only these domains of the exported prompts (chat,code,maths)")
    parser.add_argument("--formats", default="auto", help="weight formats onlinespec serves (onlinespec.formats; auto: what serve serves by default)")
    parser.add_argument("--proposers", default="hybrid,suffix", help="drafts to run on each format (factory names)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu-speculation.json")
    args = parser.parse_args()
    global BASE
    if args.target != "default":
        args.target = str(Path(args.target).expanduser())
        BASE = "llama.cpp shipped"
    RUNS.mkdir(parents=True, exist_ok=True)
    started = time.time()
    result = measure(queries(args), args)
    result["seconds"] = round(time.time() - started)
    harness.write_result(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print(report(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
