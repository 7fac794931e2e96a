"""Log probabilities of the tokens a request emitted (or was prompted with), as the target gives them.

They come from the rows of the target's own forwards that verification reads anyway: row ``i`` of
a verified block is the target's distribution at the place of the ``i``-th token the round kept,
computed on exactly the tokens before it, so the figures are the target alone's whatever the
draft proposed. As in vLLM (``logprobs_mode = "raw_logprobs"``), they are the model's: log-softmax
of the raw logits, before temperature, penalties and top-k/top-p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    rank: int = 1  # 1 + how many tokens the target found more likely
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens at this place and their log probabilities, best first


def score(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row ``i`` of ``logits`` ``[n, V]`` scores ``tokens[i]`` (``n >= len(tokens)``); with the
    ``top`` most likely tokens of each row."""
    if not tokens:
        return []
    logprobs = logits[: len(tokens)].float().log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    if not top:
        return [TokenLogprob(t, c, k) for t, c, k in zip(tokens, chosen, ranks)]
    best = logprobs.topk(top, dim=-1)
    ids, values = best.indices.tolist(), best.values.tolist()
    return [TokenLogprob(t, c, k, tuple(zip(i, v))) for t, c, k, i, v in zip(tokens, chosen, ranks, ids, values)]
