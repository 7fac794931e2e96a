"""A feature-conditioned draft head (EAGLE-style) with a vocabulary-restricted output layer.

The target's verification pass already computes its final post-norm hidden state ``f_t`` at every
position (``logits_t = W f_t``). The head reads ``f_t`` and the embedding of the token that
follows, ``x_{t+1}``, and predicts the next feature ``g_{t+1} ~ f_{t+1}``; the token it proposes
is the argmax (or a sample) of ``W_r g_{t+1}``, where ``W_r`` holds the target's own output rows
of the ``V_r`` most frequent tokens (8,192 by default: about 6x cheaper than the full 49,152-row
head, with the same agreement). To propose k tokens it feeds its own ``g`` back in, step after
step; training unrolls the same chain (:mod:`onlinespec.drafts.train`) so later steps are learned.

The body is a stack of pre-norm residual SwiGLU blocks, no attention: the target's feature already
summarises the context, a proposal costs a few small matrix-vector products and the head needs no
KV cache (so hot swaps and rollbacks are free). Copying from the context, which attention would
give, is what the n-gram proposer does; the hybrid proposer combines the two.

Only the body is trainable and saved. The embedding and the output rows are the target's (frozen,
looked up at load time), so a saved head is a few MB and binds to its target by tokenizer hash.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

CONFIG_FILE = "feature_head.json"
WEIGHTS_FILE = "feature_head.safetensors"
HEAD_VOCAB = 8192  # a head's restricted output vocabulary, fresh or distilled (the packaged head's: docs/drafts.md)
CHAIN_DEPTH = 4  # draft steps training unrolls from one target feature: as many as a head drafts at the default k


@dataclass
class FeatureHeadConfig:
    hidden_size: int  # the target's hidden size
    width: int = 0  # the body's width; 0: the target's hidden size (narrower: see FeatureHead)
    intermediate_size: int = 1024
    num_blocks: int = 2
    rms_eps: float = 1e-5
    vocab_size: int = 0  # the target's full vocabulary (restricted ids index into it)
    vocab_from_traffic: bool = False  # a fresh head: its restricted vocabulary is chosen again from served text at each update
    keep_ids: list[int] = field(default_factory=list)  # ids every vocabulary it chooses keeps (EOS)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class SwiGLUBlock(nn.Module):
    def __init__(self, hidden: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        nn.init.zeros_(self.down.weight)  # each block starts as the identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class FeatureHead(nn.Module):
    """``step(feature, token) -> next feature``; ``logits(feature) -> [.., V_r]`` over ``vocab_ids``.

    ``embedding`` [V, H] and ``out_rows`` [V_r, H] are buffers borrowed from the target (not
    parameters, not saved).
    """

    def __init__(self, config: FeatureHeadConfig, embedding: torch.Tensor, vocab_ids: torch.Tensor, out_weight: torch.Tensor) -> None:
        super().__init__()
        hidden = config.hidden_size
        if embedding.shape[-1] != hidden or out_weight.shape[-1] != hidden:
            raise ValueError(f"the target's hidden size is {embedding.shape[-1]}, the head's config says {hidden}")
        self.config = config
        self.in_norm_feature = RMSNorm(hidden, config.rms_eps)
        self.in_norm_token = RMSNorm(hidden, config.rms_eps)
        width = config.width or hidden
        self.fuse = nn.Linear(2 * hidden, width, bias=False)
        self.blocks = nn.ModuleList(SwiGLUBlock(width, config.intermediate_size, config.rms_eps) for _ in range(config.num_blocks))
        # a narrower body adds its result, projected up, to the feature it read (zero at birth: the feature passes through)
        self.up = nn.Linear(width, hidden, bias=False) if width != hidden else None
        self.out_norm = RMSNorm(hidden, config.rms_eps)
        if isinstance(embedding, torch.Tensor):
            self.register_buffer("embedding", embedding.detach(), persistent=False)
        else:  # rows read on demand from a GGUF target's file (onlinespec.ggufview.QuantizedRows)
            self.embedding = embedding
        # the target's whole output layer (shared, never saved): rows for any vocabulary
        self.out_weight = out_weight.detach() if isinstance(out_weight, torch.Tensor) else out_weight
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long), persistent=True)
        self.register_buffer("out_rows", torch.empty(0), persistent=False)
        self.register_buffer("restricted_index", torch.empty(0, dtype=torch.long), persistent=False)
        self.served_out: nn.Module | None = None  # int8 output rows, on a served copy only (:func:`served_copy`)
        self._tied_ids = torch.empty(0, dtype=torch.long)  # the ids ``out_rows`` were derived from
        self.tie_weights()

    def tie_weights(self) -> None:
        """Derive the output rows and the full-id -> restricted-index map from ``vocab_ids`` (after
        a construction, a load of saved weights, or :meth:`choose_vocab`). Rows already derived
        from the same ids are kept: a version loaded into a clone (a restart, the acceptance
        floor's starting draft) shares them with the head it was cloned from, as candidates do,
        instead of holding its own (8,192 x 576 floats here, 151,936 wide on a 1.5B target)."""
        vocab_ids = self.vocab_ids
        if self.out_rows.numel() and torch.equal(self._tied_ids, vocab_ids.detach().cpu()):
            return
        self.out_rows = self.out_weight[vocab_ids.to(self.out_weight.device)].to(self.fuse.weight.device, self.fuse.weight.dtype)
        index = torch.full((self.out_weight.shape[0],), -1, dtype=torch.long, device=vocab_ids.device)
        index[vocab_ids] = torch.arange(len(vocab_ids), device=vocab_ids.device)
        self.restricted_index = index  # -1: not in the restricted vocabulary
        self.served_out = None  # int8 rows of an older vocabulary would be stale
        self._tied_ids = vocab_ids.detach().cpu().clone()

    def choose_vocab(self, vocab_ids: torch.Tensor) -> None:
        """Serve a new restricted vocabulary of the same size (the body is vocabulary-blind)."""
        if len(vocab_ids) != len(self.vocab_ids):
            raise ValueError(f"a head's vocabulary keeps its size ({len(self.vocab_ids)}), got {len(vocab_ids)} ids")
        self.vocab_ids = vocab_ids.to(self.vocab_ids)
        self.tie_weights()

    @property
    def vocab_size(self) -> int:
        return len(self.vocab_ids)

    def step(self, feature: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """One draft step: the feature at t and the token at t + 1 -> the predicted feature at t + 1."""
        feature = feature.to(self.out_norm.weight.dtype)  # (the fuse layer may be a quantized copy's: :func:`served_copy`)
        x = torch.cat([self.in_norm_feature(feature), self.in_norm_token(self.embedding[token_ids].to(feature.device, feature.dtype))], -1)
        x = self.fuse(x)
        for block in self.blocks:
            x = block(x)
        return self.out_norm(x if self.up is None else feature + self.up(x))

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Logits over the restricted vocabulary ``[..., V_r]`` (index with ``vocab_ids``)."""
        if self.served_out is not None:  # a served copy's int8 rows (:func:`served_copy`)
            return self.served_out(feature)
        return feature @ self.out_rows.T

    def clone(self) -> FeatureHead:
        """A trainable copy that shares the frozen target tensors (embedding, output rows). Its
        ``vocab_ids`` are its own: loading weights copies them in place, and a load into the copy
        must never change the ids of the head it came from."""
        shared = (self.embedding, self.out_weight, self.out_rows, self.restricted_index)
        return copy.deepcopy(self, {id(t): t for t in shared})

    # ---- construction, saving, loading ----------------------------------------------------

    @classmethod
    def for_target(cls, target: PreTrainedModel, vocab_ids: torch.Tensor, **overrides) -> FeatureHead:
        """A fresh head for ``target``; the fuse layer starts by passing the feature through, so
        the untrained head proposes what the target would after the previous token."""
        hidden = target.config.hidden_size
        config = FeatureHeadConfig(hidden_size=hidden, vocab_size=target.config.vocab_size, **overrides)
        embedding, output = target_tables(target)
        head = cls(config, embedding, vocab_ids, output)
        with torch.no_grad():
            if head.up is not None:  # narrower: the feature passes through the residual, the body starts at zero
                head.up.weight.zero_()
                return head
            head.fuse.weight.zero_()
            head.fuse.weight[:, :hidden] = torch.eye(hidden)
            head.fuse.weight[:, hidden:] = 0.1 * torch.eye(hidden)
        return head

    @classmethod
    def fresh(cls, target: PreTrainedModel, eos_ids: list[int], vocab_size: int | None = None, **overrides) -> FeatureHead:
        """A head for a target nobody trained one for (arXiv 2310.07177, section 4: the draft
        learns from the target's verifications of live traffic). Its vocabulary starts as the
        tokenizer's first ``vocab_size`` ids (byte-pair merges come in order of frequency in the
        tokenizer's training text) plus ``eos_ids``, and is chosen again from served text at each
        update (:func:`frequent_vocab`). Its width and vocabulary size (unless given) follow the
        target's size (:func:`fresh_shape`)."""
        shape = fresh_shape(target.config.hidden_size)
        vocab_size, overrides = vocab_size or shape["vocab_size"], {"width": shape["width"], **overrides}
        start = frequent_vocab(torch.zeros(target.config.vocab_size), vocab_size, eos_ids)
        return cls.for_target(target, start, vocab_from_traffic=True, keep_ids=sorted(eos_ids), **overrides)

    def save(self, path: str | os.PathLike[str], metadata: dict | None = None) -> Path:
        """Write the head to folder ``path`` atomically (a temp folder, then a rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a saved draft is meant to be shared
        weights = {name: tensor.detach().contiguous() for name, tensor in self.state_dict().items()}
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        info = {"kind": "feature-head", "config": asdict(self.config), **(metadata or {})}
        (tmp / CONFIG_FILE).write_text(json.dumps(info, indent=2))
        old = path.with_name(f".{path.name}-old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str], target: PreTrainedModel) -> FeatureHead:
        path = Path(path)
        info = json.loads((path / CONFIG_FILE).read_text())
        config = FeatureHeadConfig(**info["config"])
        if config.vocab_size and config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"{path} was trained for a target with a {config.vocab_size}-token vocabulary; "
                f"this target has {target.config.vocab_size}"
            )
        weights = load_file(str(path / WEIGHTS_FILE))
        embedding, output = target_tables(target)
        head = cls(config, embedding, weights["vocab_ids"], output)
        head.load_state_dict(weights)
        return head.eval()

    @staticmethod
    def info(path: str | os.PathLike[str]) -> dict:
        return json.loads((Path(path) / CONFIG_FILE).read_text())


# A target wider than NARROW_FROM (a 1.5B has 1,536) gets a fresh head that is narrower than itself
# and reads fewer output rows: at the target's width, with 8,192 rows, a head's drafted token costs
# about 27M multiply-adds, a large share of a 1.5B's ~50 ms step on a 2-core CPU (docs/backends.md).
NARROW_FROM = 1024
NARROW_WIDTH, NARROW_VOCAB = 512, 4096


def fresh_shape(hidden_size: int) -> dict:
    """The body width and vocabulary size of a fresh head for a target of ``hidden_size``."""
    if hidden_size > NARROW_FROM:
        return {"width": NARROW_WIDTH, "vocab_size": NARROW_VOCAB}
    return {"width": 0, "vocab_size": HEAD_VOCAB}


def target_tables(target) -> tuple:
    """(embedding, output layer) of ``target`` as a head reads them: float32 tensors of a torch
    model, or a GGUF target's rows read on demand (:mod:`onlinespec.ggufview`: no decoder loaded)."""
    if hasattr(target, "head_tables"):
        return target.head_tables()
    return target.get_input_embeddings().weight.float().cpu(), target.get_output_embeddings().weight.float().cpu()


# Matrices of at least this many weights are served in int8 (:func:`served_copy`): on the packaged
# head every one (the output rows 8,192 x 576, the fuse layer 576 x 1,152, the blocks' gate-up
# 2,048 x 576 and down 576 x 1,024). With the fuse and down layers left in float32 (2^20, until
# 2026-12-07) they were half the bytes a drafted token reads: a step took 1.33-1.63 ms alone in a
# loop, 1.06-1.09 ms all in int8 (docs/cpu-speculation.md). Norm weights and biases stay float32.
SERVED_INT8_FROM = 1 << 18


def served_copy(head: FeatureHead) -> FeatureHead:
    """The head as it serves on a CPU: a copy whose large matrices (its output rows, the blocks'
    wide projections) are int8 with a scale per row, multiplied by PyTorch's dynamically quantized
    matmul (fbgemm/x86), about 4x fewer bytes read per drafted token than float32 (a draft step is
    memory-bound: docs/cpu-speculation.md). What it proposes is what it computes: its own logits
    define the draft distribution q the verification reads, so the output stays lossless. The
    head that trains (the learner's copy) stays float32; on a GPU, or without a quantized engine,
    the head serves as it is."""
    if head.out_rows.device.type != "cpu" or not torch.backends.quantized.engine or torch.backends.quantized.engine == "none":
        return head
    import warnings

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    served = head.clone().eval()
    out = nn.Linear(served.out_rows.shape[1], served.out_rows.shape[0], bias=False)
    out.weight = nn.Parameter(served.out_rows.detach(), requires_grad=False)
    large = {name for name, m in served.named_modules() if isinstance(m, nn.Linear) and m.weight.numel() >= SERVED_INT8_FROM}
    with warnings.catch_warnings():  # the eager dynamic-quantization API warns that torchao will replace it
        warnings.simplefilter("ignore")
        if large:
            quantize_dynamic(served, {name: per_channel_dynamic_qconfig for name in large}, dtype=torch.qint8, inplace=True)
        if out.weight.numel() >= SERVED_INT8_FROM:
            served.served_out = quantize_dynamic(nn.Sequential(out), {nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    # the int8 matrices' bytes, measured once here: they are not parameters, and torch unpacks
    # them (a copy each time) to show them (the memory budget's count, onlinespec.memory.OwnBytes)
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    served.packed_bytes = sum(w.element_size() * w.numel() for w in (m.weight() for m in served.modules() if isinstance(m, Int8Linear)))
    return served


def is_feature_head(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def frequent_vocab(token_counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """Exactly ``size`` token ids, sorted: ``always`` (e.g. EOS), then the most frequent in
    ``token_counts``, ties (unseen tokens included) going to the lower id."""
    n = len(token_counts)
    size = min(size, n)
    score = token_counts.double() + (n - torch.arange(n, dtype=torch.float64)) / (2.0 * n)  # < 0.5: breaks ties only
    score[torch.tensor(list(always), dtype=torch.long)] = float("inf")
    return torch.sort(torch.topk(score, size).indices).values
