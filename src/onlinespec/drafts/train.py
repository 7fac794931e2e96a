"""Distil a feature head on a :class:`~onlinespec.distill.signal.Signal`, later draft steps included.

A training example is a start position ``t``. Step 1 reads the target's feature ``f_t`` and the
token ``x_{t+1}`` and is scored against the target's distribution at ``t + 1``; step ``j`` reads
the head's OWN predicted feature from step ``j - 1`` (as it will when proposing) and the token
``x_{t+j}``, and is scored at ``t + j``. Gradients flow through the whole chain, so the head learns
to stay accurate on its own predictions, which is what makes k > 1 worth proposing. Step ``j``'s
loss is weighted ``step_decay ** (j - 1)``: later steps matter only when the earlier ones were
accepted.

The target's top-K distribution is mapped onto the head's restricted vocabulary; the mass of
top-K tokens outside it joins the "every other token" bucket (:mod:`onlinespec.distill.losses`),
never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from onlinespec.decoding.feature_head import CHAIN_DEPTH, FeatureHead
from onlinespec.decoding.proposers.ngram import lookup
from onlinespec.distill.losses import SparseTeacher, distill_loss
from onlinespec.distill.signal import Signal
from onlinespec.distill.step import DistillConfig, optimizer_step

# held-out positions scored at once by head_metrics (a bounded peak): a chunk's logits and the loss's
# temporaries over it were about 130 MB at 1,024 on the packaged head (8,192 ids), the largest part
# of an update's peak in the memory soak (docs/reliability.md); 256 holds about 33 MB
METRICS_CHUNK = 256
HYBRID_REPLAY = {"k": 4, "ngram": (3, 2)}  # the hybrid proposer as served (HybridProposer's n-gram bounds), replayed
_ABSENT = -1e4  # a log-probability that is exactly 0 after exp, and keeps 0 * log 0 finite


@dataclass(frozen=True)
class ChainConfig:
    depth: int = CHAIN_DEPTH  # draft steps unrolled per example
    step_decay: float = 0.8
    generated_only: bool = False  # learn only where the target was writing (not the prompt)


class ChainTask:
    """Examples (start positions) and the loss of a batch of them, for one signal."""

    def __init__(self, signal: Signal, chain: ChainConfig = ChainConfig()) -> None:
        self.signal, self.chain = signal, chain
        seq = signal.sequence_of()
        self.end = signal.starts[1:][seq]  # [T]: one past the last token of each token's sequence
        first_generated = (signal.starts[:-1] + signal.prompt_lens)[seq]
        t = torch.arange(signal.n_tokens, device=signal.ids.device)
        keep = t + 1 < self.end  # at least one step: x_{t+1} and the target's state there exist
        if chain.generated_only:
            keep &= t + 1 >= first_generated
        self.starts = t[keep]

    def __len__(self) -> int:
        return len(self.starts)

    def chain_outputs(self, head: FeatureHead, starts: torch.Tensor, depth: int | None = None):
        """Yield ``(j, logits [B, V_r], positions t + j, valid [B])`` for j = 1 .. depth."""
        depth = depth or self.chain.depth
        s = self.signal
        feature = s.features[starts].float()
        for j in range(1, depth + 1):
            pos = (starts + j).clamp_max(s.n_tokens - 1)
            valid = starts + j < self.end[starts]
            feature = head.step(feature, s.ids[pos])
            yield j, head.logits(feature), pos, valid

    def restricted_teacher(self, head: FeatureHead, pos: torch.Tensor) -> SparseTeacher:
        """The target's top-K at ``pos`` on the head's vocabulary plus one absent-token column."""
        ids = self.signal.top_ids[pos]
        index = head.restricted_index[ids]
        absent = index < 0
        logprobs = self.signal.top_logprobs[pos].float().masked_fill(absent, _ABSENT)
        return SparseTeacher(index.masked_fill(absent, head.vocab_size), logprobs)

    def loss(self, head: FeatureHead, starts: torch.Tensor, config: DistillConfig) -> torch.Tensor:
        total, weights = 0.0, 0.0
        for j, logits, pos, valid in self.chain_outputs(head, starts):
            if not bool(valid.any()):
                break
            extended = torch.cat([logits, logits.new_full((len(logits), 1), _ABSENT)], -1)
            teacher = self.restricted_teacher(head, pos)
            weight = self.chain.step_decay ** (j - 1)
            total = total + weight * distill_loss(config.loss, extended, teacher, mask=valid, temperature=config.temperature, beta=config.beta)
            weights += weight
        return total / weights

    def step(self, head: FeatureHead, optimizer: torch.optim.Optimizer, batch: list[int] | torch.Tensor, config: DistillConfig) -> float:
        """One optimizer step on a batch of start positions (a list, or a tensor on the signal's device)."""
        starts = batch if isinstance(batch, torch.Tensor) else torch.tensor(batch, device=self.starts.device)
        return optimizer_step(head, optimizer, lambda: self.loss(head, starts, config), config.max_grad_norm)


@torch.inference_mode()
def evaluate_chain(head: FeatureHead, signal: Signal, depth: int = CHAIN_DEPTH, batch: int = 4096) -> dict:
    """Greedy acceptance on ``signal``'s generated text (what serving sees), per domain and overall.

    ``step_acceptance[j-1]``: how often step j's argmax is the target's argmax, given steps
    1..j-1 were (the chance a round's j-th proposal is accepted once the earlier ones were);
    ``accepted_per_round[k-1]``: the mean number of the first k proposals accepted.
    """
    task = ChainTask(signal, ChainConfig(depth=depth, generated_only=True))
    out = {}
    domains = sorted(set(signal.domains))
    seq_domain = [signal.domains[i] for i in signal.sequence_of()[task.starts].tolist()]
    for name in ["all", *domains]:
        chosen = task.starts if name == "all" else task.starts[torch.tensor([d == name for d in seq_domain], dtype=torch.bool)]
        if len(chosen) == 0:
            continue
        correct_all, valid_all = [], []
        for first in range(0, len(chosen), batch):
            starts = chosen[first: first + batch]
            rows_correct, rows_valid = [], []
            for j, logits, pos, valid in task.chain_outputs(head, starts, depth):
                predicted = head.vocab_ids[logits.argmax(-1)]
                rows_correct.append(predicted == signal.top_ids[pos, 0])
                rows_valid.append(valid)
            correct_all.append(torch.stack(rows_correct, 1))
            valid_all.append(torch.stack(rows_valid, 1))
        correct, valid = torch.cat(correct_all), torch.cat(valid_all)
        # a chain is judged at step j only if steps < j were all accepted and t + j exists
        prefix = torch.cumprod((correct & valid).int(), 1).bool()
        judged = torch.cat([valid[:, :1], prefix[:, :-1] & valid[:, 1:]], 1)
        accepted = prefix & judged
        step_acc = (accepted.sum(0).float() / judged.sum(0).clamp_min(1)).tolist()
        out[name] = {
            "positions": int(len(chosen)),
            "step_acceptance": [round(a, 4) for a in step_acc],
            "accepted_per_round": [round(float(accepted[:, :k].sum(1).float().mean()), 4) for k in range(1, depth + 1)],
        }
    return out


def head_leading(head: FeatureHead, signal: Signal, k: int, batch: int, between: Callable[[], None]) -> torch.Tensor:
    """[T, k]: at [t, m - 1], how many of the first m greedy steps ``head`` drafts from the chain
    start t the target accepts (``between()`` after each ``batch`` of chain starts)."""
    task = ChainTask(signal, ChainConfig(depth=k, generated_only=True))
    correct = torch.zeros(signal.n_tokens, k, dtype=torch.bool)
    for first in range(0, len(task.starts), batch):
        starts = task.starts[first: first + batch]
        for j, logits, pos, valid in task.chain_outputs(head, starts, k):
            correct[starts, j - 1] = (head.vocab_ids[logits.argmax(-1)] == signal.top_ids[pos, 0]) & valid
        between()
    return torch.cumprod(correct.int(), 1).cumsum(1)


@torch.inference_mode()
def replay_acceptance(
    head: FeatureHead, signal: Signal, k: int, batch: int = 4096,
    ngram: tuple[int, int] | None = None, by_drafter: dict[str, list[int]] | None = None,
    prefixes: list | None = None, between: Callable[[], None] = lambda: None,
) -> list[tuple[int, int]]:
    """Per sequence, ``(accepted, judged)``: what greedy speculative decoding with ``head`` proposing
    ``k`` tokens a round accepts over ``signal``'s generated text, without running the target.

    ``signal`` must hold the target's greedy answers (a teacher signal at temperature 0) with its
    features: then every round is known in advance. The first round has no feature to draft from
    and emits one token; a round starting at position ``p`` drafts from the target's state at
    ``p - 2`` and the token at ``p - 1`` (as the engine does after each verification), proposes
    ``min(k, tokens left - 1)`` tokens, accepts the longest correct prefix ``n`` and moves to
    ``p + n + 1``. This reproduces a real fixed-k run up to the features' numerics (batched
    generation vs one request) and the last round of an answer cut by EOS; docs/online.md checks
    it against live runs. It is how drafts that never served a stream are scored on it.

    ``ngram=(max_ngram, min_ngram)`` replays the hybrid proposer instead: a round whose context
    ends in an n-gram seen earlier proposes what followed it, the head proposes the others.
    ``by_drafter``, when given, gains ``[accepted, judged]`` per drafter (``ngram`` / ``head``).
    ``prefixes``: per sequence, the tokens before its first row (the prompt an online record leaves
    out), which the n-gram lookup reads as serving does. ``between()`` runs after each ``batch`` of
    chain starts and every 32 sequences' rounds (where the online learner hands the engine its
    turn back).
    """
    leading = head_leading(head, signal, k, batch, between)
    ids = signal.ids.cpu().numpy()
    tally = by_drafter if by_drafter is not None else {}
    out = []
    for i in range(len(signal)):
        begin, end = int(signal.starts[i]), int(signal.starts[i + 1])
        p = begin + int(signal.prompt_lens[i]) + 1  # after the proposal-free first round
        prefix = np.asarray(prefixes[i], dtype=ids.dtype) if prefixes is not None else ids[:0]
        accepted = judged = 0
        while p < end:
            proposed = min(k, end - p - 1)
            if proposed <= 0:
                p += 1
                continue
            copied = lookup(np.concatenate([prefix, ids[begin:p]]), proposed, *ngram) if ngram else []
            if copied:
                drafter, proposed = "ngram", len(copied)
                n = int(np.cumprod(np.asarray(copied) == ids[p: p + proposed]).sum())
            else:
                drafter, n = "head", int(leading[p - 2, proposed - 1])
            judged_now = min(n + 1, proposed)  # a fully accepted round judges no extra (bonus) token
            counts = tally.setdefault(drafter, [0, 0])
            counts[0], counts[1] = counts[0] + n, counts[1] + judged_now
            accepted, judged = accepted + n, judged + judged_now
            p += n + 1
        out.append((accepted, judged))
        if i % 32 == 31:  # the rounds' lookups are a unit of work too (400 held-out records: about a second)
            between()
    return out


def records_to_signal(records, closed: bool = False) -> tuple[Signal, torch.Tensor]:
    """Online records of a feature head (:class:`~onlinespec.online.recorder.DistillRecord` with
    features) as a :class:`Signal`, and a [T] mask of its rejection rows.

    A record's positions are consecutive verified positions ``t``; row ``t - 1`` of the signal
    holds the token at ``t - 1``, the target's state there and its distribution for ``t``.
    ``closed``: each sequence also ends with its record's last token, in a row whose state and
    distribution are unknown (zeros, and a copy of the row before): only a replay, which reads
    that token and never drafts from that row, may use it.
    """
    ids, feats, top_ids, top_lp, rejected, lengths = [], [], [], [], [], []
    for r in records:
        if r.features is None:
            raise ValueError("this record has no target features: it was recorded for a draft LM, not a feature head")
        first = r.positions[0]
        if r.positions != list(range(first, first + len(r.positions))):
            raise ValueError("a feature head's record must hold consecutive positions (every verified row)")
        extra = int(closed and first + len(r.positions) <= len(r.token_ids))
        ids.append(torch.tensor(r.token_ids[first - 1: first - 1 + len(r.positions) + extra]))
        feats.append(torch.cat([r.features, r.features.new_zeros(extra, r.features.shape[1])]))
        top_ids.append(torch.cat([r.top_ids, r.top_ids[-1:].expand(extra, -1)]))
        top_lp.append(torch.cat([r.top_logprobs, r.top_logprobs[-1:].expand(extra, -1)]))
        rejected.append(torch.tensor(r.rejected + [False] * extra, dtype=torch.bool))
        lengths.append(len(r.positions) + extra)
    lengths_t = torch.tensor(lengths)
    signal = Signal(
        torch.cat(ids), torch.cat(feats), torch.cat(top_ids), torch.cat(top_lp).float(),
        torch.cat([torch.zeros(1, dtype=torch.long), lengths_t.cumsum(0)]), torch.ones(len(records), dtype=torch.long),
        [r.domain for r in records], [r.request_id for r in records],
    )
    return signal, torch.cat(rejected)


def chain_task(records, position_policy: str, chain: ChainConfig = ChainConfig()) -> ChainTask:
    """A chain task on online records; ``rejected`` keeps only the chains whose first step is a
    rejection row (where the draft was wrong: the paper's policy), ``verified`` keeps them all."""
    signal, rejected = records_to_signal(records)
    task = ChainTask(signal, chain)
    if position_policy == "rejected":
        task.starts = task.starts[rejected[task.starts + 1]]
    return task


def sparse_alpha(logits: torch.Tensor, index: torch.Tensor, top_logprobs: torch.Tensor) -> torch.Tensor:
    """Each position's alpha = sum min(p, q) over the target's stored top-K tokens and one bucket
    for every other token, for a head's logits ``[N, V_r]`` over its restricted vocabulary.
    ``index``: the top-K ids' places in that vocabulary (-1: outside it). A top-K token outside
    the head's vocabulary keeps a bucket of its own, where the head has 0: folding it into the
    rest would count a head that covers none of the text as agreeing with it (an unadapted fresh
    head on Gemma 3 scored 0.51 that way, 0.08 this way, with 3% greedy agreement)."""
    q = torch.softmax(logits.float(), -1)
    p_top = top_logprobs.float().exp()
    q_top = torch.where(index >= 0, q.gather(-1, index.clamp_min(0)), torch.zeros_like(p_top))
    rest = torch.minimum(1 - p_top.sum(-1), 1 - q_top.sum(-1)).clamp_min(0)
    return torch.minimum(p_top, q_top).sum(-1) + rest


@torch.inference_mode()
def head_metrics(head: FeatureHead, records, config: DistillConfig, chunk: int = METRICS_CHUNK,
                 between: Callable[[], None] = lambda: None, per_position: bool = False, replay: bool = False) -> dict:
    """On held-out online records: the step-1 loss, greedy agreement, and alpha = sum min(p, q)
    (over the stored top-K plus the tail bucket): the gate's figures, as for draft LMs.

    Computed ``chunk`` positions at a time: the head's logits over every held-out position at once
    would take positions x vocabulary floats (400 records x 60 positions x 8,192 ids is 0.8 GB),
    a peak that grew with the replay buffer. ``between()`` runs after each chunk: the online
    learner hands the engine its turn back there, so a step never waits for a whole evaluation.
    ``per_position``: also ``alphas``, each position's alpha (for a paired comparison of two heads
    on the same records: the gate's noise). ``replay``: also ``replayed``, what the hybrid proposer
    serving with ``head`` accepts over the records (:func:`records_replay`), and ``requests``,
    each record's ``[accepted, judged]``. ``positions``: how many positions the figures average
    over (:func:`pool_metrics` pools several calls' figures)."""
    signal, _ = records_to_signal(records)
    task = ChainTask(signal, ChainConfig(depth=1))
    if len(task) == 0:
        return {"loss": 0.0, "agreement": 0.0, "alpha": 0.0, "positions": 0,
                **({"alphas": torch.zeros(0)} if per_position else {}),
                **({"replayed": 0.0, "requests": torch.zeros(0, 2, dtype=torch.float64)} if replay else {})}
    loss = agreement = alpha = 0.0
    alphas = []
    for starts in task.starts.split(chunk):
        _, logits, pos, _ = next(task.chain_outputs(head, starts, depth=1))
        extended = torch.cat([logits, logits.new_full((len(logits), 1), _ABSENT)], -1)
        teacher = task.restricted_teacher(head, pos)
        loss += float(distill_loss(config.loss, extended, teacher, temperature=config.temperature, beta=config.beta)) * len(starts)
        agreement += float((head.vocab_ids[logits.argmax(-1)] == signal.top_ids[pos, 0]).sum())
        each = sparse_alpha(logits, head.restricted_index[signal.top_ids[pos]], signal.top_logprobs[pos])
        alpha += float(each.sum())
        if per_position:
            alphas.append(each.detach())
        between()
    n = len(task)
    out = {"loss": loss / n, "agreement": agreement / n, "alpha": alpha / n, "positions": n}
    if per_position:
        out["alphas"] = torch.cat(alphas)
    if replay:
        requests = torch.tensor(records_replay(head, records, chunk, between), dtype=torch.float64).reshape(-1, 2)
        out["replayed"], out["requests"] = float(requests[:, 0].sum() / requests[:, 1].sum().clamp_min(1)), requests
    return out


def pool_metrics(parts: list[dict]) -> dict:
    """:func:`head_metrics` over several groups of records, from each group's figures: the same
    figures one call over all the records would give (position-weighted means; the per-position
    and per-record figures concatenated; the replayed ratio recomputed from the pooled records).
    The learner's gate measures each held-out domain once and pools (half the work of measuring
    the pool again)."""
    n = sum(p["positions"] for p in parts)
    out = {key: sum(p[key] * p["positions"] for p in parts) / max(1, n) for key in ("loss", "agreement", "alpha")}
    out["positions"] = n
    for key in ("alphas", "requests"):
        if parts and all(key in p for p in parts):
            out[key] = torch.cat([p[key] for p in parts])
    if "requests" in out:
        out["replayed"] = float(out["requests"][:, 0].sum() / out["requests"][:, 1].sum().clamp_min(1))
    return out


def records_replay(head: FeatureHead, records, chunk: int = METRICS_CHUNK,
                   between: Callable[[], None] = lambda: None) -> list[tuple[int, int]]:
    """Per online record, ``(accepted, judged)``: the hybrid proposer (n-gram lookup over the prompt
    and the answer so far, ``head`` where it finds none) replayed over the recorded answer at
    ``HYBRID_REPLAY``'s k (:func:`replay_acceptance`; no target time). This is what serving with
    ``head`` would have accepted, the figure the gate's truth is measured in (arXiv 2310.07177
    section 3's alpha, as served): in the section-3 replay of docs/faster-drafts.md it agreed with
    the truth on 14-15 of 20 candidates where first-proposal alpha on the same records agreed on
    10. A record of sampled text is replayed along the sampled tokens, the head judged against the
    target's most likely token: the same proxy for both drafts a gate compares."""
    signal = records_to_signal(records, closed=True)[0]
    prefixes = [r.token_ids[: r.positions[0] - 1] for r in records]
    return replay_acceptance(head, signal, HYBRID_REPLAY["k"], batch=max(1, chunk // HYBRID_REPLAY["k"]),
                             ngram=HYBRID_REPLAY["ngram"], prefixes=prefixes, between=between)
