"""Decoding and its measurements: generate, bench, warmup, distill, costmodel."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from onlinespec.benchmark import BenchConfig
from onlinespec.cli.common import BackendOpt, DeviceOpt, DraftOpt, DtypeOpt, KOpt, TargetFormatOpt, TargetOpt, app, console, out, sampling_params, user_errors
from onlinespec.decoding.feature_head import CHAIN_DEPTH, HEAD_VOCAB
from onlinespec.decoding.proposal import DEFAULT_K
from onlinespec.factory import DEFAULT_DRAFT
from onlinespec.safety import command_line


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="the prompt text")],
    chat: Annotated[bool, typer.Option("--chat/--raw", help="wrap the prompt as a user message in the chat template")] = True,
    target: TargetOpt = "default",
    draft: DraftOpt = DEFAULT_DRAFT,
    k: KOpt = DEFAULT_K,
    dtype: DtypeOpt = "auto",
    backend: BackendOpt = "auto",
    device: DeviceOpt = "auto",
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy")] = 0.0,
    top_p: float = 1.0,
    top_k: Annotated[int, typer.Option(min=0)] = 0,
    seed: int | None = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="print per-request statistics to stderr")] = False,
) -> None:
    """Generate text for one prompt, streaming it to stdout."""
    from onlinespec.factory import load_decoder

    params = sampling_params(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop or ()))
    with console.status("loading models"):
        decoder = user_errors(lambda: load_decoder(target, draft, k, dtype, backend=backend, device=device))
    request = [{"role": "user", "content": prompt}] if chat else prompt

    def stream_out():
        final = None
        for chunk in decoder.stream(request, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            final = chunk.stats or final
        sys.stdout.write("\n")
        return final

    final = user_errors(stream_out)
    if stats and final is not None:
        console.print_json(json.dumps(final.to_dict()))


@app.command()
def bench(
    prompts: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="JSONL: {'prompt'|'messages', 'domain'?, 'max_new_tokens'?}")],
    json_out: Annotated[Path, typer.Option("--json", help="where to write the results")],
    target: TargetOpt = "default",
    draft: DraftOpt = BenchConfig.draft,
    k: KOpt = BenchConfig.k,
    dtype: DtypeOpt = BenchConfig.dtype,
    backend: BackendOpt = BenchConfig.backend,
    device: DeviceOpt = BenchConfig.device,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="for prompts that do not set it")] = BenchConfig.max_new_tokens,
    temperature: Annotated[float, typer.Option(min=0.0)] = BenchConfig.temperature,
    top_p: float = BenchConfig.top_p,
    top_k: Annotated[int, typer.Option(min=0)] = BenchConfig.top_k,
    seed: int = BenchConfig.seed,
    hf: Annotated[bool, typer.Option("--hf/--no-hf", help="also run Hugging Face assisted generation")] = BenchConfig.hf_assisted,
    pad_verify: Annotated[bool, typer.Option("--pad-verify/--no-pad-verify", help="pad verification blocks to the widths this CPU runs fastest")] = BenchConfig.pad_verify,
    adaptive_k: Annotated[bool, typer.Option("--adaptive-k/--fixed-k", help="per step, verify only the proposals the cost model says pay")] = BenchConfig.adaptive_k,
    kernels: Annotated[bool, typer.Option("--kernels/--no-kernels", help="small-batch linear kernels for the target, if measured faster (all methods run them)")] = BenchConfig.small_batch_kernels,
    llama_cpp: Annotated[bool, typer.Option("--llama-cpp/--no-llama-cpp", help="llama.cpp targets: also plain llama.cpp (llama-cpp-python's own generation) on the file as given, greedy")] = BenchConfig.llama_cpp,
    target_format: TargetFormatOpt = BenchConfig.target_format,
    concurrency: Annotated[str | None, typer.Option(help="comma-separated levels, e.g. 1,2,4,8: serve the prompts with that many in flight (batched), target alone vs speculative; writes a PNG beside the JSON")] = None,
) -> None:
    """Target alone vs our speculative decoding vs HF assisted generation, side by side
    (``--concurrency``: both batched, at each number of requests in flight)."""
    from onlinespec.benchmark import plot_concurrency
    from onlinespec.data import read_queries_jsonl

    levels = user_errors(lambda: _levels(concurrency)) if concurrency else None
    queries = user_errors(lambda: read_queries_jsonl(prompts))
    config = BenchConfig(target, draft, k, dtype, backend, device, max_new_tokens, temperature, top_p, top_k, seed, hf, pad_verify,
                         adaptive_k, kernels, llama_cpp=llama_cpp, target_format=target_format)
    summary = _run_concurrency_bench(queries, config, levels) if levels else _run_bench(queries, config)
    summary["command"] = command_line(sys.argv[1:])
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(summary, indent=2))
    if levels:
        print_concurrency(summary)
        plot_concurrency(summary, json_out.with_suffix(".png"))
        console.print(f"wrote {json_out} and {json_out.with_suffix('.png')}")
        return
    print_bench(summary)
    console.print(f"wrote {json_out}")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency takes comma-separated whole numbers like 1,2,4,8, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


@app.command()
def warmup(
    out_dir: Annotated[Path, typer.Option("--out", help="folder the trained head is written to")],
    target: TargetOpt = "default",
    dtype: DtypeOpt = "bfloat16",
    steps: Annotated[int, typer.Option(min=1, help="optimizer steps")] = 3000,
    batch_size: Annotated[int, typer.Option(min=1, help="start positions per step")] = 256,
    lr: Annotated[float, typer.Option(min=0.0)] = 1e-3,
    loss: Annotated[str, typer.Option(help="fkl, rkl, jsd or tvd")] = "fkl",
    depth: Annotated[int, typer.Option(min=1, help="draft steps unrolled in training")] = CHAIN_DEPTH,
    vocab_size: Annotated[int, typer.Option(min=16, help="size of the head's restricted output vocabulary")] = HEAD_VOCAB,
    per_domain: Annotated[int, typer.Option(min=1, help="chat and code warm-up queries each")] = 600,
    extra_chat: Annotated[int, typer.Option(min=0, help="more chat warm-up queries (a separate cached part)")] = 1200,
    extra_code: Annotated[int, typer.Option(min=0, help="more code warm-up queries (a separate cached part)")] = 374,
    math_languages: Annotated[str, typer.Option(help="comma-separated GSM-Symbolic languages besides English ('' for none)")] = "deu,fra,spa",
    math_samples: Annotated[int, typer.Option(min=0, help="sampled answers per English maths problem")] = 3,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="tokens the target writes per warm-up query")] = 128,
) -> None:
    """Build a feature-head draft for a target: the target answers warm-up queries (batched, cached),
    then the head is distilled on them. Stop it at any time; the same command resumes."""
    import dataclasses

    from onlinespec.drafts.warmup import HeadRecipe, WarmupData, warm_feature_head
    from onlinespec.models import load_model

    loaded = user_errors(lambda: load_model(target, dtype))
    recipe = user_errors(lambda: HeadRecipe(vocab_size=vocab_size, depth=depth, steps=steps, batch_size=batch_size, lr=lr, loss=loss))
    languages = tuple(lang for lang in math_languages.split(",") if lang)
    data = dataclasses.replace(
        WarmupData(), per_domain=per_domain, extra_chat=extra_chat, extra_code=extra_code,
        math_languages=languages, math_samples=math_samples, max_new_tokens=max_new_tokens,
    )
    meta = user_errors(lambda: warm_feature_head(loaded, str(out_dir), recipe, data))
    meta["command"] = command_line(sys.argv[1:])
    (out_dir / "warmup.json").write_text(json.dumps(meta, indent=2))
    for domain, fig in meta["heldout"].items():
        console.print(f"{domain:6s} step acceptance {fig['step_acceptance']}  accepted per round (k=1..) {fig['accepted_per_round']}")
    console.print(f"wrote {out_dir}")


@app.command()
def distill(
    json_out: Annotated[Path, typer.Option("--json", help="where the held-out evaluation goes")],
    start: Annotated[str, typer.Option(help="head folder to start from")],
    domain: Annotated[str, typer.Option(help="chat, code or math: the domain to specialise on")],
    signal: Annotated[str, typer.Option(help="teacher, student, mixed or fixed")] = "teacher",
    loss: Annotated[str, typer.Option(help="fkl, rkl, jsd or tvd")] = "fkl",
    out_dir: Annotated[Path | None, typer.Option("--out", help="also save the distilled head here")] = None,
    target: TargetOpt = "default",
    dtype: DtypeOpt = "bfloat16",
    queries: Annotated[int, typer.Option(min=1, help="warm-up queries of the domain to learn from")] = 200,
    steps: Annotated[int, typer.Option(min=1)] = 300,
    lr: Annotated[float, typer.Option(min=0.0)] = 3e-4,
    mix_ratio: Annotated[float, typer.Option(min=0.0, max=1.0, help="mixed: share of tokens from the student")] = 0.5,
) -> None:
    """Distil one configuration (signal x loss) from a starting head on one domain, and report
    held-out acceptance per domain (one cell of Table 1)."""
    from onlinespec.drafts.specialise import DistillRun, run_distill
    from onlinespec.models import load_model

    loaded = user_errors(lambda: load_model(target, dtype))
    run = user_errors(lambda: DistillRun(domain=domain, signal=signal, loss=loss, queries=queries, steps=steps, lr=lr, mix_ratio=mix_ratio))
    result = user_errors(lambda: run_distill(loaded, start, run, out_dir))
    result["command"] = command_line(sys.argv[1:])
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))
    console.print(json.dumps(result["heldout"], indent=1))




@app.command()
def costmodel(
    alpha: Annotated[float, typer.Option(min=0.0, max=1.0)],
    c: Annotated[float, typer.Option(min=0.0, help="draft step time / target step time")],
    verify_cost: Annotated[float, typer.Option(min=0.0, help="verification pass / one target step")] = 1.0,
    k_max: Annotated[int, typer.Option(min=1)] = 10,
) -> None:
    """Print the paper's expected tokens per round and speedup for k = 1..k_max."""
    from onlinespec import costmodel as cm

    table = Table(title=f"alpha {alpha}, c {c}, verify cost {verify_cost}")
    for col in ("k", "tokens/round", "speedup"):
        table.add_column(col, justify="right")
    for kk in range(1, k_max + 1):
        table.add_row(str(kk), f"{cm.expected_tokens_per_round(alpha, kk):.3f}", f"{cm.speedup(alpha, kk, c, verify_cost):.3f}")
    out.print(table)
    out.print(f"best k: {cm.best_k(alpha, c, k_max, verify_cost)}")



def _run_bench(queries, config, target=None) -> dict:
    from onlinespec.benchmark import run_bench

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}")]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(f"bench {config.draft} k={config.k}", total=len(queries), info="")

        def on_prompt(i, result):
            rate = {m: result.new_tokens[m] / result.seconds[m] for m in result.seconds}
            info = "  ".join(f"{m} {r:.1f} tok/s" for m, r in rate.items()) + f"  alpha {result.acceptance_rate:.2f}"
            progress.update(task, advance=1, info=info)

        return user_errors(lambda: run_bench(queries, config, on_prompt, target))


def _run_concurrency_bench(queries, config, levels) -> dict:
    from onlinespec.benchmark import run_concurrency_bench

    with console.status("loading the target and measuring its cost curve") as status:
        def on_level(level, method, fig):
            console.print(f"concurrency {level} {method}: {fig['tokens_per_s']:.1f} tok/s, latency p50 {fig['latency_p50_s']:.2f} s, "
                          f"alpha {fig['acceptance_rate']:.2f}, mean k {fig['mean_k']:.2f}")
            status.update(f"concurrency {level}: {method} done")

        return user_errors(lambda: run_concurrency_bench(queries, config, levels, on_level=on_level))


def print_concurrency(summary: dict) -> None:
    table = Table(title=f"{summary['n_prompts']} prompts, draft {summary['config']['draft']}, k <= {summary['config']['k']}, both batched")
    for col in ("in flight", "target alone tok/s", "ours tok/s", "ours/target", "predicted", "latency p50 / p99 (s)",
                "TTFT p50 / p99 (s)", "alpha", "tau", "mean k", "identical"):
        table.add_column(col, justify="right")
    for level, fig in summary["concurrency"].items():
        spec, alone = fig["speculative"], fig["target_alone"]
        table.add_row(level, f"{alone['tokens_per_s']:.1f}", f"{spec['tokens_per_s']:.1f}", f"{fig['speedup_vs_target']:.2f}x",
                      f"{fig['predicted_speedup']:.2f}x" if "predicted_speedup" in fig else "-",
                      f"{spec['latency_p50_s']:.2f} / {spec['latency_p99_s']:.2f}", f"{spec['ttft_p50_s']:.2f} / {spec['ttft_p99_s']:.2f}",
                      f"{spec['acceptance_rate']:.3f}", f"{spec['tau']:.2f}", f"{spec['mean_k']:.2f}",
                      f"{spec.get('greedy_identical', '-')}/{summary['n_prompts']}")
    out.print(table)


def print_bench(summary: dict) -> None:
    table = Table(title=f"{summary['n_prompts']} prompts, draft {summary['draft']}, k = {summary['k']}")
    for col in ("domain", "n", "target alone tok/s", "ours tok/s", "HF assisted tok/s", "llama.cpp tok/s", "alpha", "tau",
                "ours/target", "ours/HF", "ours/llama.cpp", "predicted", "greedy identical"):
        table.add_column(col, justify="right")
    rows = [("all", summary)] + list(summary["domains"].items())
    for name, fig in rows:
        hf = fig.get("hf_assisted", {}).get("tokens_per_s")
        spec = fig["speculative"]
        table.add_row(
            name,
            str(fig["n_prompts"]),
            f"{fig['target_alone']['tokens_per_s']:.1f}",
            f"{spec['tokens_per_s']:.1f}",
            f"{hf:.1f}" if hf else "-",
            f"{fig['llama_cpp']['tokens_per_s']:.1f}" if "llama_cpp" in fig else "-",
            f"{spec['acceptance_rate']:.3f}",
            f"{spec['mean_accepted_length']:.2f}",
            f"{fig['speedup_vs_target']:.2f}x",
            f"{fig['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in fig else "-",
            f"{fig['speedup_vs_llama_cpp']:.2f}x" if "speedup_vs_llama_cpp" in fig else "-",
            f"{fig['predicted_speedup']:.2f}x" if "predicted_speedup" in fig else "-",
            f"{spec.get('greedy_identical', '-')}/{fig['n_prompts']}" if "greedy_identical" in spec else "-",
        )
    out.print(table)
    cost = summary.get("cost_model")
    if cost:
        out.print(
            f"cost model: alpha {cost['alpha']:.3f}, c {cost['c']:.3f}, verify cost {cost['verify_cost']:.2f} -> "
            f"predicted {cost['predicted_speedup']:.2f}x (paper's formula, verify = 1: {cost['paper_predicted_speedup']:.2f}x); "
            f"engine overhead {summary['speculative']['engine_overhead_fraction']:.1%} of request time"
        )
        if cost.get("c_by_drafter"):
            out.print("c by drafter (draft time per drafted token / one target step): "
                      + ", ".join(f"{d} {c:.3f}" for d, c in cost["c_by_drafter"].items()))
