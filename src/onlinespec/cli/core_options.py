"""The serving core's options, shared by every command that serves (`serve`, `online`): one list,
defaults from the config dataclasses, turned into one :class:`CoreConfig` (:func:`with_core_options`)."""

from __future__ import annotations

import functools
import inspect
from typing import Annotated, Optional

import typer

from onlinespec.cli.common import BackendOpt, DeviceOpt, DraftOpt, KOpt, NglOpt, TargetFormatOpt, user_errors
from onlinespec.distill.step import DistillConfig
from onlinespec.memory import parse_size
from onlinespec.online.learner import LearnerConfig
from onlinespec.routing.content import ContentConfig
from onlinespec.serve.config import CoreConfig, tenant_weights


def _memory_size(value: str | None) -> int | None:
    """--memory-budget in bytes (None: the default), or a usage error that says how to write it."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err


# The serving core's options, shared by `serve` and `online` (defaults from the config dataclasses).
CORE_OPTIONS: dict[str, tuple] = {
    "target": (Annotated[str, typer.Option("--target", "--model", help="'default' (packaged SmolLM2-135M-Instruct), a HF folder or a .gguf file (--model: vLLM's name)")], CoreConfig.target),
    "draft": (DraftOpt, CoreConfig.draft),
    "k": (KOpt, CoreConfig.k),
    "dtype": (Annotated[str, typer.Option(help="torch backend: float32, float16, bfloat16 or auto (bfloat16 on CUDA, else float32); llama.cpp: auto only (the GGUF file's quantisation decides)")], CoreConfig.dtype),
    "backend": (BackendOpt, CoreConfig.backend),
    "device": (DeviceOpt, CoreConfig.device),
    "target_format": (TargetFormatOpt, CoreConfig.target_format),
    "expected_acceptance": (Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="--target-format auto: the acceptance this deployment's traffic reaches "
                                                                         "(vllm:spec_decode_num_accepted_tokens / num_draft_tokens, or bench's): decide at start; without it auto serves the format chosen before")],
                            CoreConfig.expected_acceptance),
    "n_gpu_layers": (NglOpt, CoreConfig.n_gpu_layers),
    "mmap": (Annotated[bool, typer.Option("--mmap/--no-mmap", help="llama.cpp: map the GGUF file (its pages count in resident memory, even those of "
                                                                  "weights repacked into memory of their own), or read the weights (llama.cpp's --no-mmap)")], CoreConfig.mmap),
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
    "cold_steps": (Annotated[int, typer.Option(min=1, help="a draft born from the target (a fresh head) takes this many times the steps")],
                   LearnerConfig.cold_steps),
    "shift_updates": (Annotated[int, typer.Option(min=0, help="a draft's first updates on traffic it has not learnt from (a new draft, a drift) take --shift-scale times the rate and steps")],
                      LearnerConfig.shift_updates),
    "shift_scale": (Annotated[float, typer.Option(min=0.001, help="see --shift-updates (1: no larger steps)")], LearnerConfig.shift_scale),
    "batch_size": (Annotated[int, typer.Option(min=1, help="examples per learner step")], LearnerConfig.batch_size),
    "lr": (Annotated[float, typer.Option(help="learner learning rate (> 0)")], LearnerConfig.lr),
    "learner_threads": (Annotated[int, typer.Option(min=1, help="torch threads of the learner thread, in the engine's turns too (more slow llama.cpp down: onlinespec.online.budget)")], LearnerConfig.threads),
    "priority": (Annotated[str, typer.Option(help="learner thread priority: low (nice 19), idle (SCHED_IDLE: serving preempts it at once) or normal")], LearnerConfig.priority),
    "cpu_share": (Annotated[float, typer.Option(min=0.01, max=1.0, help="the most wall time the learner computes")], LearnerConfig.cpu_share),
    "learn_share": (Annotated[float, typer.Option(min=0.0, max=1.0, help="under load, the most of the engine's wall time draft updates take: they "
                                                  "compute in turns the engine gives them, never beside a step (idle: all of it); "
                                                  "0: in a thread beside serving, at --priority")], CoreConfig.learn_share),
    "gate": (Annotated[str, typer.Option(help="judge a candidate on the newest records held out of its training ('holdout') or train it on every "
                                               "record and judge it on the requests served next ('next': docs/faster-drafts.md, section 3)")], LearnerConfig.gate),
    "gate_metric": (Annotated[str, typer.Option(help="the figure a candidate is judged by: 'replayed', what the hybrid proposer serving with it "
                                                      "accepts over the judged records (a feature head), 'alpha', step-1 alpha (docs/faster-drafts.md, section 3), "
                                                      "or 'auto', replayed but alpha while a head born from the target is cold (docs/online-learning.md)")],
                    LearnerConfig.gate_metric),
    "gate_by": (Annotated[str, typer.Option(help="gate on the newest records of each 'domain' (a candidate must lose on none) or the 'newest' records pooled")], LearnerConfig.gate_by),
    "floor": (Annotated[bool, typer.Option("--floor/--no-floor", help="serve the starting draft again while a learned one accepts less than it "
                                           "on the gate's held-out records (paired, 95%), until a candidate beats it")], LearnerConfig.floor),
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
    "enable_prefix_caching": (Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="llama.cpp: a new prompt reuses the "
                                                             "KV cells of the longest prefix an earlier request of its tenant (and cache_salt) computed (vLLM's flag; on by default, as in vLLM V1)")],
                              CoreConfig.enable_prefix_caching),
    "prefix_cache_cells": (Annotated[Optional[int], typer.Option(min=1, help="the most KV cells (tokens) finished requests keep for prefix caching, "
                                                                 "least recently used out first (default: one request's context; each context's worth is one more llama.cpp sequence)")],
                           CoreConfig.prefix_cache_cells),
    "max_waiting": (Annotated[int, typer.Option(min=0, help="requests queued for a slot; more are refused with 429 and Retry-After")], CoreConfig.max_waiting),
    "shared_suffix": (Annotated[bool, typer.Option(help="one suffix index per draft for all tenants: more acceptance, but a client's proposals then reveal other clients' text (docs/reliability.md)")], CoreConfig.shared_suffix),
    "speculation_details": (Annotated[bool, typer.Option(help="responses say which drafter proposed what (by_drafter): a side channel on other requests' text, off by default")], CoreConfig.speculation_details),
    "max_domains": (Annotated[int, typer.Option(min=1, help="distinct request domains a server accepts (each is a metrics label); a new one past this is a 400")], CoreConfig.max_domains),
    "request_timeout": (Annotated[float, typer.Option(min=0.001, help="seconds a request may take, queueing included")], CoreConfig.request_timeout),
    "default_max_tokens": (Annotated[int, typer.Option(min=0, help="new tokens of a request that names no max_tokens, within the context left (0: all the context left, as vLLM; docs/serve.md, 'Scheduling')")], CoreConfig.default_max_tokens),
    "tenant_max_running": (Annotated[int | None, typer.Option(min=1, help="the most batch slots (running choices) one tenant holds (default: --max-batch; its fair share whenever another tenant has work waiting)")], CoreConfig.tenant_max_running),
    "tenant_max_queued_tokens": (Annotated[int, typer.Option(min=0, help="tokens (prompts + max_tokens left) one tenant's waiting choices may hold; its new requests past this get 429 (0: no cap)")], CoreConfig.tenant_max_queued_tokens),
    "tenant_weight": (Annotated[list[str] | None, typer.Option(help="TENANT=WEIGHT: the tenant's weight in the fair share of the batch (default 1); repeat it")], None),
    "held_decode_share": (Annotated[float, typer.Option(min=0.01, max=1.0, help="while a tenant within its share decodes, the most of the time the tenants over their share of the slots (with requests waiting) get, their rows and prompts; past it they sit steps out (llama.cpp; 1.0: every row every step; docs/serve.md, 'Scheduling')")], CoreConfig.held_decode_share),
    "retention_days": (Annotated[Optional[float], typer.Option(help="delete training records (and event-log lines) older than this many days (default: keep)")], CoreConfig.retention_days),
    "max_buffer_bytes": (Annotated[int, typer.Option(min=1, help="the most bytes a draft's replay buffer keeps on disk (oldest out first)")], CoreConfig.max_buffer_bytes),
    "suffix_tokens": (Annotated[int, typer.Option(min=0, help="the most tokens a draft's suffix index of earlier requests keeps (0: it learns nothing)")], CoreConfig.suffix_tokens),
    "memory_budget": (Annotated[Optional[str], typer.Option(callback=_memory_size, help="memory the replay buffers, suffix indexes and drafts may hold together, e.g. 2GiB or 512MiB (a bare number is MiB; default: a quarter of the RAM, 1 GiB to 8 GiB); past it the oldest records and the least-recently-used tenants' suffix documents are evicted (docs/serve.md)")], None),
    "keep_versions": (Annotated[int, typer.Option(min=0, help="keep this many newest draft versions, plus the current one, its parent and the first, the starting draft (0: keep all)")], LearnerConfig.keep_versions),
    "max_failures": (Annotated[int, typer.Option(min=1, help="updates failing in a row before a learner stops trying (serving goes on)")], LearnerConfig.max_failures),
}


def _core_config(o: dict) -> CoreConfig:
    learner = LearnerConfig(
        update_interval=o["update_interval"], interval_unit=o["interval_unit"], position_policy=o["positions"], sampling=o["sampling"],
        distill=DistillConfig(loss=o["loss"], beta=o["beta"]), steps_per_update=o["steps_per_update"],
        cold_steps=o["cold_steps"], shift_updates=o["shift_updates"], shift_scale=o["shift_scale"], batch_size=o["batch_size"],
        lr=o["lr"], threads=o["learner_threads"], priority=o["priority"], cpu_share=o["cpu_share"], gate=o["gate"], gate_metric=o["gate_metric"], gate_by=o["gate_by"], floor=o["floor"],
        keep_versions=o["keep_versions"], max_failures=o["max_failures"],
    )
    plain = {name: o[name] for name in ("target", "draft", "k", "dtype", "backend", "device", "target_format", "expected_acceptance", "n_gpu_layers", "mmap", "learn", "head_updates", "buffer_policy", "buffer_records", "router",
                                         "max_drafts", "adaptive_k", "kernels", "max_batch", "max_waiting", "max_domains", "shared_suffix", "speculation_details", "request_timeout",
                                         "retention_days", "max_buffer_bytes", "suffix_tokens", "memory_budget",
                                         "enable_prefix_caching", "prefix_cache_cells")}
    content = ContentConfig(threshold=o["cluster_threshold"], merge_threshold=o["merge_threshold"],
                            distance_lambda=o["drift_distance_lambda"], alpha_lambda=o["drift_alpha_lambda"])
    fair = {"default_max_tokens": o["default_max_tokens"] or None, "tenant_max_queued_tokens": o["tenant_max_queued_tokens"] or None,
            "tenant_max_running": o["tenant_max_running"], "tenant_weights": tenant_weights(o["tenant_weight"] or ()),  # issue 46: 0 is "no cap"
            "held_decode_share": o["held_decode_share"]}
    return CoreConfig(**plain, **fair, learner=learner, content=content, learn_share=o["learn_share"] or None)


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
        return command(**kwargs, core=user_errors(lambda: _core_config(options)))

    wrapper.__signature__ = signature.replace(parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared)
    return wrapper
