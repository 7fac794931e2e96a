"""Side-by-side benchmark: the target alone, our speculative decoding, Hugging Face assisted generation.

All three run on the same prompts, interleaved prompt by prompt in one process, so machine noise
hits them alike. For each prompt the order of the three is rotated. Figures are aggregates
(total new tokens / total seconds) plus medians of per-prompt ratios.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from onlinespec.baselines import HFAssisted, PlainLlamaCpp
from onlinespec.costmodel import estimate, expected_tokens_per_round
from onlinespec.data import Query
from onlinespec.decoding import kernels
from onlinespec.decoding.proposal import DEFAULT_K
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import Generation
from onlinespec.factory import DEFAULT_DRAFT, engine_options, make_proposer, new_decoder
from onlinespec.metrics import median_ratio, percentile
from onlinespec.models import LoadedModel, load_target

METHODS = ("target_alone", "speculative", "hf_assisted", "llama_cpp")  # llama_cpp: plain llama.cpp on the file as shipped
# Greedy outputs may differ only where the target's top two logits are this close: verifying
# k + 1 tokens in one pass and one token per pass round differently in the last bits.
NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.15, "gguf": 0.25}  # gguf: llama.cpp's quantised kernels


@dataclass
class BenchConfig:
    target: str = "default"
    draft: str = DEFAULT_DRAFT
    k: int = DEFAULT_K
    dtype: str = "float32"
    backend: str = "auto"  # what runs the target (onlinespec.backends): llama.cpp for a GGUF file on a CPU
    device: str = "auto"
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    hf_assisted: bool = True  # torch targets: also Hugging Face assisted generation
    pad_verify: bool = True  # pad verification blocks to the widths this CPU runs fastest
    adaptive_k: bool = True  # per step, verify only the proposals the cost model says pay
    small_batch_kernels: bool = True  # W @ X^T for 2-16 rows if measured faster (target alone runs them too)
    llama_cpp: bool = True  # llama.cpp targets: also plain llama.cpp on the file as shipped (greedy only)
    target_format: str = "auto"  # llama.cpp: the weight format onlinespec serves (onlinespec.formats)


@dataclass
class PromptResult:
    id: str
    domain: str
    prompt_tokens: int
    new_tokens: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    greedy_identical: bool | None = None
    divergence_logit_gap: float | None = None  # top-2 logit gap where a greedy output diverged


def run_bench(
    queries: Sequence[Query],
    config: BenchConfig,
    on_prompt: Callable[[int, PromptResult], None] | None = None,
    target: LoadedModel | None = None,
) -> dict:
    """Run the three methods on every query and return the summary (see :func:`summarize`).
    ``target``: the already loaded ``config.target``, to share one model across runs."""
    if not queries:
        raise ValueError("no prompts to benchmark")
    target = target or load_target(config.target, config.dtype, config.backend, config.device, target_format=config.target_format)
    config = resolved(config, target)
    choice = make_proposer(config.draft, target, config.dtype)
    if choice.proposer is None:
        raise ValueError("benchmark needs a draft: 'none' leaves nothing to compare")
    options = engine_options(target, config.k, pad=config.pad_verify, adaptive=config.adaptive_k, kernels=config.small_batch_kernels)
    decoders = {"target_alone": new_decoder(target, None, 0), "speculative": new_decoder(target, choice.proposer, config.k, options)}
    baselines = {}
    if config.hf_assisted and target.backend == "torch":
        baselines["hf_assisted"] = HFAssisted(target, choice, config.k)
    if config.llama_cpp and target.backend == "llama.cpp" and config.temperature == 0:
        baselines["llama_cpp"] = PlainLlamaCpp(target.gguf_source or target.gguf)
    methods = [m for m in METHODS if m in decoders or m in baselines]
    _warm_up(decoders, baselines, queries[0])

    results, runs = [], {"target_alone": [], "speculative": []}
    for i, query in enumerate(queries):
        params = _params(config, query, seed=config.seed + i)
        prompt = list(query.messages) if query.messages else query.prompt
        outputs: dict[str, Generation | tuple[list[int], float]] = {}
        for method in methods[i % len(methods):] + methods[: i % len(methods)]:
            if method in baselines:
                outputs[method] = baselines[method].generate(decoders["target_alone"].encode(prompt), params)
            else:
                outputs[method] = decoders[method].generate(prompt, params)
        result = _prompt_result(query, outputs, params, target)
        for method in ("target_alone", "speculative"):
            runs[method].append(outputs[method].stats)
        results.append(result)
        if on_prompt:
            on_prompt(i, result)
    summary = summarize(results, runs, config, kernels.enabled(target.model))
    summary["target_file"] = str(target.gguf) if target.gguf else config.target  # the weights onlinespec served
    if "llama_cpp" in baselines:
        summary["llama_cpp_file"] = str(baselines["llama_cpp"].gguf)
    return summary


def resolved(config: BenchConfig, target: LoadedModel) -> BenchConfig:
    """``config`` with the backend and device that run ``target`` (what the report names)."""
    return replace(config, backend=target.backend, device=str(target.device.type))


def near_tie(config: BenchConfig) -> float:
    """The largest top-2 logit gap at which a greedy divergence counts as a near-tie."""
    return NEAR_TIE["gguf"] if config.backend == "llama.cpp" else NEAR_TIE.get(config.dtype, NEAR_TIE["float32"])


def _params(config: BenchConfig, query: Query, seed: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=query.max_new_tokens or config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        seed=seed,
    )


def _warm_up(decoders: dict, baselines: dict, query: Query) -> None:
    prompt = list(query.messages) if query.messages else query.prompt
    params = SamplingParams(max_new_tokens=8)
    for decoder in decoders.values():
        decoder.generate(prompt, params)
    for baseline in baselines.values():
        baseline.generate(decoders["target_alone"].encode(prompt), params)


def _prompt_result(query: Query, outputs: dict, params: SamplingParams, target: LoadedModel) -> PromptResult:
    ar, spec = outputs["target_alone"], outputs["speculative"]
    result = PromptResult(query.id, query.domain, len(ar.prompt_ids))
    for method, out in outputs.items():
        if isinstance(out, Generation):
            result.new_tokens[method], result.seconds[method] = len(out.token_ids), out.stats.seconds
        else:
            result.new_tokens[method], result.seconds[method] = len(out[0]), out[1]
    result.acceptance_rate = spec.stats.acceptance_rate
    result.mean_accepted_length = spec.stats.mean_accepted_length
    if params.greedy:
        result.greedy_identical = spec.token_ids == ar.token_ids
        if not result.greedy_identical:
            result.divergence_logit_gap = divergence_gap(target, ar.prompt_ids, ar.token_ids, spec.token_ids)
    return result


@torch.inference_mode()
def divergence_gap(target: LoadedModel, prompt_ids: list[int], a: list[int], b: list[int], runner=None) -> float:
    """The gap between the target's two best logits where greedy outputs ``a`` and ``b`` first
    differ, as its own backend computes them (one forward alone; ``runner``: a batch-of-one runner
    of ``target`` to reuse, else one is made: on llama.cpp a context each)."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    runner, row = runner or target.runner(1), object()
    logits, _ = runner.forward_alone(row, prompt_ids + a[:at], 1)
    runner.release([row])
    top = logits[-1].topk(2).values
    return float(top[0] - top[1])


# ------------------------------------------------------------------------------------------------
# Summary
# ------------------------------------------------------------------------------------------------


def summarize(results: list[PromptResult], runs: dict[str, list], config: BenchConfig, kernels_on: bool = False) -> dict:
    summary = {
        "n_prompts": len(results),
        "k": config.k,
        "draft": config.draft,
        "config": asdict(config),
        "machine": machine_info(),
        "small_batch_kernels_on": kernels_on,
        **_figures(results, runs, config),
        "domains": {},
        "prompts": [asdict(r) for r in results],
    }
    for domain in sorted({r.domain for r in results}):
        keep = [i for i, r in enumerate(results) if r.domain == domain]
        domain_runs = {m: [runs[m][i] for i in keep] for m in runs}
        summary["domains"][domain] = {"n_prompts": len(keep), **_figures([results[i] for i in keep], domain_runs, config)}
    return summary


def _figures(results: list[PromptResult], runs: dict[str, list], config: BenchConfig) -> dict:
    methods = [m for m in METHODS if m in results[0].seconds]
    out: dict = {}
    for m in methods:
        tokens, seconds = sum(r.new_tokens[m] for r in results), sum(r.seconds[m] for r in results)
        out[m] = {"tokens_per_s": tokens / seconds, "new_tokens": tokens, "seconds": seconds}
    spec_stats = runs["speculative"]
    accepted, rejected = sum(s.accepted for s in spec_stats), sum(s.rejected for s in spec_stats)
    out["speculative"].update(
        acceptance_rate=accepted / max(accepted + rejected, 1),
        mean_accepted_length=sum(s.new_tokens for s in spec_stats) / sum(s.rounds for s in spec_stats),
        proposed=sum(s.proposed for s in spec_stats),
        accepted=accepted,
        engine_overhead_fraction=sum(s.overhead_seconds for s in spec_stats) / sum(s.seconds for s in spec_stats),
        step_acceptance=_step_acceptance(spec_stats),
        mean_proposed_per_round=sum(s.proposed for s in spec_stats) / sum(s.rounds for s in spec_stats),
    )
    if config.temperature == 0:
        out["speculative"]["greedy_identical"] = sum(bool(r.greedy_identical) for r in results)
        gaps = [r.divergence_logit_gap for r in results if r.divergence_logit_gap is not None]
        out["speculative"]["divergences_max_logit_gap"] = max(gaps) if gaps else None
        out["speculative"]["divergences_all_near_ties"] = all(g <= near_tie(config) for g in gaps)
    out["speedup_vs_target"] = out["speculative"]["tokens_per_s"] / out["target_alone"]["tokens_per_s"]
    out["median_speedup_vs_target"] = _median_ratio(results, "speculative", "target_alone")
    if "hf_assisted" in out:
        out["speedup_vs_hf"] = out["speculative"]["tokens_per_s"] / out["hf_assisted"]["tokens_per_s"]
        out["median_speedup_vs_hf"] = _median_ratio(results, "speculative", "hf_assisted")
        out["hf_speedup_vs_target"] = out["hf_assisted"]["tokens_per_s"] / out["target_alone"]["tokens_per_s"]
    if "llama_cpp" in out:  # against what a llama.cpp user runs on the file as shipped
        out["speedup_vs_llama_cpp"] = out["speculative"]["tokens_per_s"] / out["llama_cpp"]["tokens_per_s"]
        out["median_speedup_vs_llama_cpp"] = _median_ratio(results, "speculative", "llama_cpp")
        out["target_alone_vs_llama_cpp"] = out["target_alone"]["tokens_per_s"] / out["llama_cpp"]["tokens_per_s"]
    cost = _cost_estimate(runs, config.k)
    if cost is not None:
        out["cost_model"] = {
            **asdict(cost),
            "predicted_speedup": cost.predicted_speedup,
            "paper_predicted_speedup": cost.paper_predicted_speedup,
        }
        out["predicted_speedup"] = cost.predicted_speedup
        out["cost_model"]["c_by_drafter"] = draft_cost_by_drafter(runs)
    return out


def draft_cost_by_drafter(runs: dict[str, list]) -> dict[str, float]:
    """c per drafter (``Proposal.drafter``: ngram, suffix, head, ...): the draft seconds of the
    rounds it proposed in, per token it proposed, over one step of the target alone; from rounds
    verified alone (batch 1), where a step's draft call is that round's."""
    ar_steps = [t.target_seconds for s in runs["target_alone"] for t in s.timings[1:]]
    if not ar_steps:
        return {}
    step = statistics.fmean(ar_steps)
    seconds: dict[str, float] = {}
    proposed: dict[str, int] = {}
    for stats in runs["speculative"]:
        for t in stats.timings[1:]:
            if t.proposed and t.batch == 1 and t.drafter:
                seconds[t.drafter] = seconds.get(t.drafter, 0.0) + t.draft_seconds
                proposed[t.drafter] = proposed.get(t.drafter, 0) + t.proposed
    return {d: seconds[d] / proposed[d] / step for d in sorted(seconds)}


def _step_acceptance(stats: list) -> list[float]:
    """Per draft step j: accepted / judged (judged = every earlier proposal of the round was accepted)."""
    depth = max((len(s.step_judged) for s in stats), default=0)
    judged = [sum(s.step_judged[j] for s in stats if j < len(s.step_judged)) for j in range(depth)]
    accepted = [sum(s.step_accepted[j] for s in stats if j < len(s.step_accepted)) for j in range(depth)]
    return [a / n if n else 0.0 for a, n in zip(accepted, judged)]


def _median_ratio(results: list[PromptResult], a: str, b: str) -> float:
    rate = lambda r, m: r.new_tokens[m] / r.seconds[m]
    return median_ratio([(rate(r, a), rate(r, b)) for r in results])


def _cost_estimate(runs: dict[str, list], k: int):
    """alpha, c and verify cost from the runs' steady-state rounds (round 0 holds the prefill)."""
    ar_steps = [t.target_seconds for s in runs["target_alone"] for t in s.timings[1:]]
    spec_rounds = [t for s in runs["speculative"] for t in s.timings[1:]]
    proposed = sum(t.proposed for t in spec_rounds)
    stats = runs["speculative"]
    if not ar_steps or not spec_rounds or sum(s.accepted + s.rejected for s in stats) == 0:
        return None
    step = statistics.fmean(ar_steps)
    # Rounds proposing fewer than k (a request's last tokens, an n-gram miss) are a different
    # workload: the verify cost is measured on the full rounds.
    full = [t.target_seconds for t in spec_rounds if t.proposed == k] or [t.target_seconds for t in spec_rounds]
    return estimate(
        accepted=sum(s.accepted for s in stats),
        rejected=sum(s.rejected for s in stats),
        k=k,
        draft_seconds_per_step=sum(t.draft_seconds for t in spec_rounds) / max(proposed, 1),
        target_seconds_per_step=step,
        verify_seconds_per_round=statistics.fmean(full),
    )


def machine_info() -> dict:
    """Where and when a figure was measured: every result JSON of `bench` and bench/ carries it."""
    memory = _proc_field("/proc/meminfo", "MemTotal")
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": _proc_field("/proc/cpuinfo", "model name") or platform.machine(),
        "cpu_count": os.cpu_count(),
        "ram_gib": round(int(memory.split()[0]) / 2**20, 1) if memory else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "llama_cpp_python": next((d.version for d in importlib.metadata.distributions(name="llama_cpp_python")), None),
        "python": platform.python_version(),
        "git_commit": _git_commit(),
    }


def _proc_field(path: str, key: str) -> str | None:
    with contextlib.suppress(OSError):
        return next((line.split(":", 1)[1].strip() for line in open(path) if line.split(":", 1)[0].strip() == key), None)
    return None


def _git_commit() -> str | None:
    """The checkout's commit (with "-dirty" when files differ from it); None outside a checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"], check=False, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


# ------------------------------------------------------------------------------------------------
# Many requests at once
# ------------------------------------------------------------------------------------------------


def run_concurrency_bench(
    queries: Sequence[Query],
    config: BenchConfig,
    levels: Sequence[int],
    target: LoadedModel | None = None,
    on_level: Callable[[int, str, dict], None] | None = None,
) -> dict:
    """Serve every query at each concurrency level (that many requests in flight; a new one
    enters as soon as one finishes), with the target alone and with speculative decoding, both
    batched by the same engine and scheduler. Greedy outputs are checked against the target
    alone at concurrency 1; the extended cost model's predicted speedup is set beside the
    measured one (:func:`predicted_speedup`)."""
    if not queries or not levels or min(levels) < 1:
        raise ValueError("need queries and concurrency levels >= 1")
    target = target or load_target(config.target, config.dtype, config.backend, config.device, target_format=config.target_format)
    config = resolved(config, target)
    choice = make_proposer(config.draft, target, config.dtype)
    options = engine_options(target, config.k, pad=config.pad_verify, adaptive=config.adaptive_k,
                             kernels=config.small_batch_kernels, max_batch=max(levels))
    decoders = {
        "target_alone": new_decoder(target, None, 0, {"cost_curve": options.get("cost_curve"), "pad": config.pad_verify}, max(levels)),
        "speculative": new_decoder(target, choice.proposer, config.k, options, max(levels)),
    }
    _warm_up(decoders, {}, queries[0])
    prompts = [list(q.messages) if q.messages else q.prompt for q in queries]
    params = [_params(config, q, seed=config.seed + i) for i, q in enumerate(queries)]
    reference: list[list[int]] | None = None
    result: dict = {"n_prompts": len(queries), "config": asdict(config), "machine": machine_info(),
                    "small_batch_kernels_on": kernels.enabled(target.model),
                    "cost_curve_ms": options["cost_curve"].milliseconds(3) if options.get("cost_curve") else None,
                    "concurrency": {}}
    for n, level in enumerate(levels):
        figures, outputs = {}, {}
        order = ["target_alone", "speculative"][:: 1 if n % 2 == 0 else -1]  # alternate who runs first
        for method in order:
            steps: list = []
            start = time.perf_counter()
            outs = decoders[method].generate_many(prompts, params, max_batch=level, on_step=steps.append)
            wall = time.perf_counter() - start
            figures[method], outputs[method] = _level_figures(outs, steps, wall), [o.token_ids for o in outs]
            if on_level:
                on_level(level, method, figures[method])
        reference = reference or outputs["target_alone"]  # the target alone at the first level
        if config.temperature == 0:
            for method in order:
                figures[method].update(_identity(target, outputs[method], reference, queries, decoders["target_alone"], near_tie(config)))
        spec, alone = figures["speculative"], figures["target_alone"]
        figures["speedup_vs_target"] = spec["tokens_per_s"] / alone["tokens_per_s"]
        curve = options.get("cost_curve")
        if curve is not None:
            figures["predicted_speedup"] = predicted_speedup(curve, spec, alone, config.pad_verify)
        result["concurrency"][str(level)] = figures
    return result


def _level_figures(outs: list[Generation], steps: list, wall: float) -> dict:
    stats = [o.stats for o in outs]
    tokens = sum(s.new_tokens for s in stats)
    judged = sum(s.accepted + s.rejected for s in stats)
    rounds = sum(s.rounds for s in stats)
    verify = [s for s in steps if s.batch]
    weight = sum(s.batch for s in verify) or 1
    return {
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(outs) / wall,
        "seconds": wall,
        "new_tokens": tokens,
        "latency_p50_s": percentile([s.latency_seconds for s in stats], 50),
        "latency_p99_s": percentile([s.latency_seconds for s in stats], 99),
        "ttft_p50_s": percentile([s.ttft_seconds for s in stats], 50),
        "ttft_p99_s": percentile([s.ttft_seconds for s in stats], 99),
        "acceptance_rate": sum(s.accepted for s in stats) / judged if judged else 0.0,
        "tau": tokens / rounds if rounds else 0.0,
        "mean_k": sum(s.proposed for s in stats) / rounds if rounds else 0.0,
        "step_acceptance": _step_acceptance(stats),
        # the batched forwards, weighted by the requests in them: what the cost model is fed
        "steps": len(steps),
        "mean_batch": sum(s.batch * s.batch for s in verify) / weight,  # as a request sees it
        "batch_per_step": weight / max(len(verify), 1),  # as the engine sees it: requests per forward
        "mean_width": sum(s.width * s.batch for s in verify) / weight,
        "mean_context": sum(s.context * s.batch for s in verify) / weight,
        "speculating_share": sum(s.batch for s in verify if s.width > 1) / weight,
        "forward_seconds_per_step": sum(s.target_seconds for s in verify) / max(len(verify), 1),
        "draft_seconds_per_step": sum(s.draft_seconds for s in verify) / max(len(verify), 1),
        "prefill_seconds": sum(s.prefill_seconds for s in steps),
        "prefill_share": sum(s.prefill_seconds for s in steps) / wall,
    }


def _identity(target: LoadedModel, outs: list[list[int]], reference: list[list[int]], queries, alone, tie: float) -> dict:
    identical = sum(a == b for a, b in zip(outs, reference))
    gaps = [divergence_gap(target, alone.encode(list(q.messages) if q.messages else q.prompt), ref, out)
            for out, ref, q in zip(outs, reference, queries) if out != ref]
    return {"greedy_identical": identical, "divergences_max_logit_gap": max(gaps) if gaps else None,
            "divergences_all_near_ties": all(g <= tie for g in gaps)}


def predicted_speedup(curve, spec: dict, alone: dict, pad: bool = True) -> float:
    """The extended cost model's speedup for a run, from its measured alpha, proposal length,
    batch size and context: a decoding step emits ``B * E(alpha, k)`` tokens (the paper's i.i.d.
    formula, arXiv 2310.07177, background) and costs the measured curve's forward of ``B`` rows of width
    ``1 + k`` at that context, plus the draft's measured time per step; the target alone emits
    ``B`` tokens per width-1 forward. Prompt prefill is not what the model is about: both runs
    prefill the same prompts, and each run's measured prefill seconds are added to its time."""
    def cost(fig: dict, width: float) -> float:
        batch = fig["batch_per_step"]
        at = (lambda w: curve.padded_cost(batch, w, fig["mean_context"])) if pad else (lambda w: curve.cost(batch, w, fig["mean_context"]))
        low = int(width)
        return at(low) + (width - low) * (at(low + 1) - at(low)) if width > low else at(low)

    def seconds(fig: dict, tokens_per_row_step: float, step_cost: float) -> float:
        return fig["new_tokens"] / (fig["batch_per_step"] * tokens_per_row_step / step_cost) + fig["prefill_seconds"]

    spec_step = cost(spec, 1 + spec["mean_k"]) + spec["draft_seconds_per_step"]
    return seconds(alone, 1.0, cost(alone, 1)) / seconds(spec, _e_fractional(spec["acceptance_rate"], spec["mean_k"]), spec_step)


def _e_fractional(alpha: float, k: float) -> float:
    """E(alpha, k) for a mean proposal length k: linear between the integer lengths around it."""
    low = int(k)
    lo, hi = expected_tokens_per_round(alpha, low), expected_tokens_per_round(alpha, low + 1)
    return lo + (k - low) * (hi - lo)


def plot_concurrency(summary: dict, path) -> None:
    """Throughput and p50 latency against requests in flight, target alone vs speculative."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [int(n) for n in summary["concurrency"]]
    figs = list(summary["concurrency"].values())
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method, label in (("target_alone", "target alone"), ("speculative", "speculative")):
        left.plot(levels, [f[method]["tokens_per_s"] for f in figs], marker="o", label=label)
        right.plot(levels, [f[method]["latency_p50_s"] for f in figs], marker="o", label=label)
    for n, f in zip(levels, figs):
        left.annotate(f"{f['speedup_vs_target']:.2f}x", (n, f["speculative"]["tokens_per_s"]), textcoords="offset points", xytext=(4, 6))
    left.set(xlabel="requests in flight", ylabel="output tokens / s", title="throughput")
    right.set(xlabel="requests in flight", ylabel="seconds", title="latency p50 per request")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{summary['n_prompts']} prompts, {summary['config']['max_new_tokens']} new tokens, {summary['machine']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
