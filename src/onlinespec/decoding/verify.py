"""The acceptance math of speculative decoding (arXiv 2310.07177, background). Pure tensor code: no models, no I/O.

A round proposes ``k`` tokens ``x_1..x_k``; the target scores them in one forward pass, giving
``k + 1`` distributions: ``p_i`` at the position of ``x_i`` and ``p_{k+1}`` after ``x_k``.

- Greedy: accept while ``x_i == argmax p_i``; the first mismatch is replaced by ``argmax p_i``;
  if all ``k`` match, the bonus token is ``argmax p_{k+1}``. Identical to target-alone greedy.
- Sampling: accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first
  rejection draw the correction from ``norm(max(0, p_i - q_i))``; if all are accepted draw the
  bonus from ``p_{k+1}``. The emitted tokens follow ``p`` exactly (Leviathan et al. 2023).

Every round emits ``n_accepted + 1`` tokens: the accepted proposals, then ``next_token``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from onlinespec.decoding.sampling import sample


@dataclass(frozen=True)
class Verdict:
    n_accepted: int  # proposals accepted, a prefix of the k proposed
    next_token: int  # the correction at the first rejection, or the bonus token if all accepted


def verify_greedy(proposals: list[int], target_logits: torch.Tensor) -> Verdict:
    """Greedy acceptance. ``target_logits``: ``[k + 1, V]`` (any monotone transform of logits works)."""
    choices = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(proposals) and proposals[n] == choices[n]:
        n += 1
    return Verdict(n, choices[n])


def verify_sampling(
    proposals: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Exact rejection sampling.

    Args:
        proposals: the ``k`` proposed token ids, each drawn from its row of ``draft_probs``.
        draft_probs: ``[k, V]``, the draft distribution ``q_i`` each proposal was drawn from;
            ``None`` for a deterministic proposer (each ``q_i`` a point mass on ``x_i``).
        target_probs: ``[k + 1, V]``, the target's sampling distributions ``p_i`` (after
            temperature / top-k / top-p, exactly as the target alone would sample).
        generator: the request's random generator.
    """
    k = len(proposals)
    if k == 0:
        return Verdict(0, sample(target_probs[0], generator))
    rows = torch.arange(k)
    index = torch.tensor(proposals)
    p = target_probs[rows, index]
    q = draft_probs[rows, index] if draft_probs is not None else torch.ones(k)
    u = torch.rand(k, generator=generator)
    rejected = (u * q >= p).tolist()  # accept iff u < p/q, without a division; p = 0 always rejects (even u = 0)
    n = rejected.index(True) if True in rejected else k
    if n == k:
        return Verdict(k, sample(target_probs[k], generator))
    return Verdict(n, sample(residual_distribution(target_probs[n], draft_probs, proposals, n), generator))


def residual_distribution(
    p: torch.Tensor, draft_probs: torch.Tensor | None, proposals: list[int], n: int
) -> torch.Tensor:
    """``norm(max(0, p - q_n))``: what the target still owes after the draft's proposal was rejected."""
    if draft_probs is None:  # point mass: p with the rejected token removed
        residual = p.clone()
        residual[proposals[n]] = 0
    else:
        residual = (p - draft_probs[n]).clamp_min_(0)
    total = residual.sum()
    # A rejection implies p(x) < q(x) somewhere, hence mass here; guard against round-off only.
    return residual / total if total > 0 else p
