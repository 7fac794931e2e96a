"""From a :class:`~onlinespec.serve.config.CoreConfig` to the parts a serving core runs: the target,
the engine and its scheduler, the router and the pool of drafts (with their learners), the
baselines served by name, the learning share and the recorder.

:class:`~onlinespec.serve.core.ServingCore` calls :func:`load_configured_target` and :func:`build`
on its engine thread (the target's load and the cost curve's measurement are model work), then
opens the pool (:meth:`CoreParts.open`) once it holds the parts, so that the pool's events reach
a core that knows its pool. Building emits no event.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from onlinespec import memory
from onlinespec.decoding.engine import SpeculativeEngine
from onlinespec.decoding.proposers.suffix_files import SUFFIX_FILE, replica_suffix_file
from onlinespec.decoding.scheduler import FairScheduler
from onlinespec.factory import FRESH, engine_options, make_proposer
from onlinespec.models import LoadedModel, load_target
from onlinespec.online.pool import DraftPool, ServedDraft, saved_drafts
from onlinespec.routing.domains import Router
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import STATIC, TARGET_ALONE, Handle
from onlinespec.serve.learning import LearningShare
from onlinespec.serve.metrics import ServeMetrics
from onlinespec.serve.writer import RecordWriter
from onlinespec.tokens import eos_token_ids, tokenizer_fingerprint


@dataclass
class CoreHooks:
    """What the parts call back into the core with."""

    event: Callable[[dict], None]  # an event-log line
    learner_event: Callable[[dict], None]  # a draft's or learner's event (the pool's on_event)
    event_served: Callable[[dict], None]  # a learning event, stamped with the requests served
    notify_engine: Callable[[], None]  # wake the engine loop
    release: Callable[[Handle], None]  # give back the drafts a content route holds


@dataclass
class CoreParts:
    tokenizer: object
    eos: frozenset[int]
    engine: SpeculativeEngine
    scheduler: FairScheduler
    identity: dict  # target, draft, tokenizer fingerprint: what a saved draft must match
    share: LearningShare | None  # when learning takes the engine's turns (CoreConfig.learn_share)
    pool: DraftPool
    baselines: dict[str, ServedDraft]  # drafts served by name, never trained: the target alone, static
    recorder: RecordWriter  # not started
    start_event: dict  # the event-log line that says how the core starts
    open_fresh: bool  # the fresh baseline opens with the pool (serve --fresh-baseline)

    def open(self, event: Callable[[dict], None]) -> None:
        """Open the pool: the fresh baseline, the start event, a previous run's drafts (refused
        now, at start-up, if they are another model's)."""
        if self.open_fresh:
            self.pool.open(FRESH)
        event(self.start_event)
        self.pool.open_saved()


def load_configured_target(config: CoreConfig) -> LoadedModel:
    """The target the config names, on the backend and device it names."""
    return load_target(config.target, config.dtype, config.backend, config.device, target_format=config.target_format,
                       n_gpu_layers=config.n_gpu_layers, mmap=config.mmap, expected_acceptance=config.expected_acceptance)


def build(config: CoreConfig, target: LoadedModel, out_dir: Path, metrics: ServeMetrics, hooks: CoreHooks,
          replica: str | None = None, learners: Callable[[str, object], object] | None = None) -> CoreParts:
    """The parts of a core serving ``target`` from ``out_dir`` (``replica``, ``learners``: as
    :class:`~onlinespec.serve.core.ServingCore` takes them). Measures the target's cost curve
    when the config drafts (seconds)."""
    tokenizer = target.tokenizer
    if config.chat_template is not None:  # --chat-template: it renders every chat request's messages
        tokenizer.chat_template = config.chat_template
    eos = eos_token_ids(target.model, tokenizer)
    speculative = config.draft != "none"
    options = engine_options(target, config.k, adaptive=config.adaptive_k, kernels=config.kernels,
                             max_batch=config.max_batch) if speculative else {}
    adaptive = options.get("adaptive_k")

    def new_draft(spec: str = config.draft):
        """A fresh starting draft with acceptance statistics of its own."""
        return make_proposer(spec, target, config.dtype).proposer, copy.deepcopy(adaptive)

    runner = target.runner(config.max_batch, options.get("cost_curve"), options.get("pad", False), context=config.max_model_len,
                           prefix_cache=config.enable_prefix_caching, prefix_cache_cells=config.prefix_cache_cells)
    metrics.prefix_cache(lambda: getattr(runner, "prefix_cache", None))  # its cells and evictions on /metrics (llama.cpp only)
    engine = SpeculativeEngine(runner, eos, config.k if speculative else 0, prefill_chunk=config.prefill_chunk)
    if config.max_model_len is not None and engine.context < config.max_model_len:
        raise ValueError(f"--max-model-len {config.max_model_len} is past this model's context of {engine.context} tokens: give at most that")
    learning = config.learning
    content = config.router == "content" and learning and config.head_updates
    router = Router(config.router if learning and (content or config.router != "content") else "single", config.max_drafts,
                    saved_drafts(out_dir) if learning else ())
    identity = {"target": config.target, "draft": config.draft, "tokenizer": tokenizer_fingerprint(tokenizer)}
    share = None
    if learning and config.learn_share is not None and not replica:  # a Ray replica's learners are actors
        share = LearningShare(config.learn_share, metrics, lambda: pool.drafts, hooks.event_served, hooks.notify_engine, adaptive, config.k)
    memory.configure(config.memory_budget or memory.default_limit(), on_event=hooks.event)  # the process's budget (onlinespec.memory)
    pool_config = config.pool_config(identity, learner=config.learner if learning and config.head_updates else None,
                                     suffix_tokens=config.suffix_tokens if learning else 0, content=config.content if content else None,
                                     suffix_file=replica_suffix_file(replica) if replica else SUFFIX_FILE, keeps_buffers=not replica)
    pool = DraftPool(new_draft, out_dir, router, pool_config, on_event=hooks.learner_event, learners=learners,
                     turns=share.turns if share is not None else None,
                     born={FRESH: lambda: new_draft(config.fresh_draft)} if config.fresh_baseline else None)
    baselines = {TARGET_ALONE: ServedDraft(TARGET_ALONE, None, None, None)}
    if content:  # the content router's floor is servable by name too
        baselines[STATIC] = pool.content.static
    elif config.static_baseline and speculative:
        baselines[STATIC] = ServedDraft(STATIC, *new_draft(), None)
    curve = options.get("cost_curve")
    if curve is not None:
        metrics.target_step(curve.cost(1, 1))  # the unit of c on /metrics
    start = {"event": "start", "router": router.policy, "learn": learning, "draft": config.draft, "max_batch": config.max_batch,
             "backend": target.backend, "device": str(target.device), "context": engine.context,
             "cost_curve_ms": curve.milliseconds() if curve else None}
    recorder = RecordWriter(pool, metrics, config, hooks.event, hooks.release, replica, on_served=share.served if share is not None else None)
    scheduler = FairScheduler(engine, config.max_batch, config.tenant_max_running, config.tenant_weights, held_share=config.held_decode_share)
    metrics.scheduler(scheduler)
    return CoreParts(tokenizer, eos, engine, scheduler, identity, share, pool, baselines, recorder, start,
                     open_fresh=config.fresh_baseline and speculative)
