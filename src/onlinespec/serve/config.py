"""The serving core's settings (``onlinespec serve`` and ``onlinespec online`` fill them from their
options; a Ray deployment sends them to every replica and learner actor)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from onlinespec.decoding.engine import DEFAULT_K, DEFAULT_PREFILL_CHUNK
from onlinespec.decoding.scheduler import DEFAULT_MAX_BATCH
from onlinespec.decoding.step_shares import DEFAULT_HELD_SHARE
from onlinespec.factory import DEFAULT_DRAFT, DEFAULT_DTYPE
from onlinespec.online.learner import LearnerConfig
from onlinespec.online.pool import PoolConfig
from onlinespec.routing.content import ContentConfig
from onlinespec.routing.domains import MAX_DRAFTS, ROUTERS

DEFAULT_MAX_TOKENS = 4096  # new tokens of a request that names no max_tokens (docs/serve.md, "Scheduling")
DEFAULT_TENANT_QUEUED_TOKENS = 1 << 18  # tokens one tenant's waiting choices may hold before its new requests get 429


@dataclass
class CoreConfig:
    target: str = "default"
    draft: str = DEFAULT_DRAFT
    k: int = DEFAULT_K
    dtype: str = DEFAULT_DTYPE
    backend: str = "auto"  # what runs the target: llama.cpp for a GGUF file on a CPU, else torch (onlinespec.backends)
    device: str = "auto"  # torch backend: cuda when torch sees one, else cpu
    target_format: str = "auto"  # llama.cpp: the weight format served (onlinespec.formats: auto, as-is, q8_0, f16, ...)
    expected_acceptance: float | None = None  # target_format auto: decide at start at this acceptance (None: the recorded choice)
    n_gpu_layers: int = 0  # llama.cpp: layers a GPU build offloads (-ngl; -1: all)
    mmap: bool = True  # llama.cpp: map the GGUF file (its pages count as resident) or read the weights into memory (--no-mmap)
    learn: bool = True  # the drafts learn online (off: serve them static, suffix index included)
    head_updates: bool = True  # learning trains the learned draft too (off: only the suffix index learns)
    buffer_policy: str = "window"
    buffer_records: int = 2000
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    router: str = "domain"  # domain: one draft per request domain; single: one shared draft; content: by prompt clusters
    max_drafts: int = MAX_DRAFTS  # domain: domains beyond this many share one draft; content: drafts kept in memory
    content: ContentConfig = field(default_factory=ContentConfig)  # the content router's clusters and detectors
    adaptive_k: bool = True  # per-step k from the measured cost curve (off: always k proposals)
    kernels: bool = True  # small-batch linear kernels when they measure faster
    max_batch: int = DEFAULT_MAX_BATCH  # requests verified per step
    max_waiting: int = 64  # requests (HTTP requests, whatever their choices) queued for a slot; beyond this one is refused (429)
    tenant_max_running: int | None = None  # the most slots (running choices) one tenant holds (None: max_batch; its fair share
    # whenever another tenant has work waiting: onlinespec.decoding.scheduler)
    tenant_max_queued_tokens: int | None = DEFAULT_TENANT_QUEUED_TOKENS  # a tenant's waiting choices' tokens (text + budget left)
    # past which its new requests are refused (429); None: no cap
    tenant_weights: dict[str, float] = field(default_factory=dict)  # tenant -> its weight in the fair share (others: 1)
    held_decode_share: float = DEFAULT_HELD_SHARE  # of the time, for tenants over their share of the slots while
    # another tenant decodes (onlinespec.decoding.step_shares, which checks it; 1.0: their rows decode every step)
    max_domains: int = 64  # distinct request domains (metrics labels, routes); a new one beyond this is refused
    shared_suffix: bool = False  # one suffix index per draft for every tenant (each tenant's proposals then reveal others' text)
    speculation_details: bool = False  # responses carry per-position and per-drafter acceptance (a side channel: off by default)
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS  # when a request gives no max_tokens, within the context left
    # (None: all the context left, as vLLM; docs/serve.md, "Scheduling")
    request_timeout: float = 600.0  # seconds from arrival; a request still running then fails
    static_baseline: bool = False  # also serve the starting draft kept static, as draft "static"
    fresh_baseline: bool = False  # also serve, as draft "fresh", the same kind of draft born from nothing (DRAFT:fresh),
    # learning from the requests sent to it by name: the cold start beside the packaged head, on the same server
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    # llama.cpp: finished requests' KV cells serve new prompts of the same tenant and cache_salt that begin
    # the same way (onlinespec.decoding.prefix_cache; on by default, as in vLLM V1), at most this many cells
    # (None: one request's context)
    enable_prefix_caching: bool = True
    prefix_cache_cells: int | None = None
    log_text: bool = False  # request log lines carry prompt and output text
    retention_days: float | None = None  # records (and event-log lines) older than this are deleted; None: kept
    max_buffer_bytes: int = 512 * 2**20  # the most bytes a draft's replay buffer keeps (oldest out first)
    suffix_tokens: int = 500_000  # the most tokens a draft's suffix index of earlier requests keeps (0: it learns nothing)
    memory_budget: int | None = None  # bytes the replay buffers, suffix indexes and drafts may hold together
    # (onlinespec.memory; None: a quarter of the machine's RAM, 1 GiB to 8 GiB)
    served_model_name: str | None = None  # the name clients send and the vllm: metrics' model_name (None: model_name(target))
    max_model_len: int | None = None  # cap the context (prompt + output) at this many tokens (None: the model's own)
    chat_template: str | None = None  # the Jinja chat template to render messages with (None: the tokenizer's own)
    learn_share: float | None = 0.1  # under load, the most of the engine's wall time updates take (in its turns,
    # onlinespec.online.turns; idle: all of it); None: updates run beside serving in a thread at low priority

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}: use one of {ROUTERS}")
        if self.k < 0 or self.max_batch < 1 or self.max_waiting < 0 or (self.default_max_tokens or 1) < 1 or self.max_domains < 1:
            raise ValueError("k >= 0, max_batch >= 1, max_waiting >= 0, default_max_tokens >= 1 and max_domains >= 1 are required")
        if (self.tenant_max_running or 1) < 1 or (self.tenant_max_queued_tokens or 1) < 1 or any(not w > 0 for w in self.tenant_weights.values()):
            raise ValueError("tenant_max_running >= 1, tenant_max_queued_tokens >= 1 and tenant weights > 0 are required")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.retention_days is not None and not self.retention_days > 0:
            raise ValueError(f"retention_days must be > 0 (or unset: keep records), got {self.retention_days}")
        if self.max_buffer_bytes < 1:
            raise ValueError(f"max_buffer_bytes must be >= 1, got {self.max_buffer_bytes}")
        if self.memory_budget is not None and self.memory_budget < 1:
            raise ValueError(f"memory_budget must be a positive number of bytes (or unset: the default), got {self.memory_budget}")
        if self.suffix_tokens < 0:
            raise ValueError(f"suffix_tokens must be >= 0 (0: the suffix index learns nothing), got {self.suffix_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 tokens (or unset: the model's context), got {self.max_model_len}")
        if self.fresh_baseline and (self.draft.partition(":")[0] not in ("hybrid", "head") or self.router == "content" or not self.learn):
            raise ValueError(f"a fresh baseline is a head born from the target, learning: it needs --draft hybrid or head (not "
                             f"{self.draft!r}), learning on, and a router other than content (its drafts are the clusters')")
        if self.prefix_cache_cells is not None and self.prefix_cache_cells < 1:
            raise ValueError(f"prefix_cache_cells must be >= 1 (or unset: one request's context), got {self.prefix_cache_cells}")
        if self.learn_share is not None and not 0.0 < self.learn_share <= 1.0:
            raise ValueError(f"learn_share must lie in (0, 1] (or unset: updates in a low-priority thread), got {self.learn_share}")

    @property
    def fresh_draft(self) -> str:
        """The spec of the fresh baseline: the draft's kind, born from the target (``hybrid:fresh``)."""
        return f"{self.draft.partition(':')[0]}:fresh"

    @property
    def model_name(self) -> str:
        """The served model's name: ``served_model_name``, else :func:`model_name` of the target."""
        return self.served_model_name or model_name(self.target)

    @property
    def retention_seconds(self) -> float | None:
        return None if self.retention_days is None else self.retention_days * 86400.0

    @property
    def learning(self) -> bool:
        return self.learn and self.draft != "none"

    def pool_config(self, identity: dict, **settings) -> PoolConfig:
        """The draft pool's settings (:class:`~onlinespec.online.pool.PoolConfig`) from these; ``settings``
        override (what the serving core's pool keeps and a learner actor's differ)."""
        return replace(PoolConfig(learner=self.learner, buffer_policy=self.buffer_policy, buffer_records=self.buffer_records,
                                  buffer_bytes=self.max_buffer_bytes, retention_seconds=self.retention_seconds, identity=identity,
                                  max_in_memory=self.max_drafts), **settings)


def model_name(target: str) -> str:
    """The name a server answers to by default: 'default' for the packaged target, else the folder or file name."""
    return "default" if target == "default" else Path(target).stem or target


def tenant_weights(entries) -> dict[str, float]:
    """``--tenant-weight TENANT=WEIGHT`` entries as a dict; a ValueError names a malformed one."""
    weights = {}
    for entry in entries:
        name, _, value = (part.strip() for part in entry.partition("="))
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"--tenant-weight {entry!r}: give TENANT=WEIGHT, e.g. team-a=2") from None
        if not name or not weights[name] > 0:
            raise ValueError(f"--tenant-weight {entry!r}: give a tenant name and a weight > 0")
    return weights
