"""Logits processors that read a request's history: ``logit_bias``, ``min_tokens`` and the
repetition, presence and frequency penalties (vLLM's sampling extras and OpenAI's penalties).

They run on the target's logits before :func:`~onlinespec.decoding.sampling.logits_to_probs` (and
before the argmax when greedy), in vLLM's order: bias, the ``min_tokens`` mask, then penalties.
A verification block scores several positions at once; row ``i`` of it is the distribution after
the request's output so far plus the block's first ``i`` proposals, so each row is processed with
its own history: the processed target is then exactly what the target alone would sample from
one token at a time, and verification stays lossless (arXiv 2310.07177, background).

Conventions (vLLM's): the repetition penalty counts the prompt and the output; presence and
frequency penalties count the output only; ``min_tokens`` masks EOS (unless ``ignore_eos``) and
the stop token ids until that many tokens are out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from onlinespec.decoding.sampling import SamplingParams


def apply_processors(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int],
                     first: int, stop_ids: Iterable[int] = ()) -> torch.Tensor:
    """Process ``logits`` ``[n, V]``: row ``i`` follows the output ``output[: first + i]``.

    ``output``: the request's new tokens, then the block's proposals (``first`` of them are out
    already). ``stop_ids``: the tokens ``min_tokens`` holds back (EOS and ``stop_token_ids``).
    Returns ``logits`` itself when no processor is on.
    """
    if not params.processed:
        return logits
    n, vocab = logits.shape
    logits = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long)
        logits[:, ids] += torch.tensor([b for t, b in params.logit_bias if t < vocab])
    if params.min_tokens:
        held = [i for i in range(n) if first + i < params.min_tokens]
        stops = torch.tensor(sorted({t for t in stop_ids if t < vocab}), dtype=torch.long)
        if held and len(stops):
            logits[torch.tensor(held)[:, None], stops[None, :]] = float("-inf")
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        counts = output_counts(output, first, n, vocab)
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            seen[:, _ids(prompt, vocab)] = True
            penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            logits = torch.where(seen, penalised, logits)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def output_counts(output: Sequence[int], first: int, n: int, vocab: int) -> torch.Tensor:
    """``[n, V]``: how often each token occurs in ``output[: first + i]``, row ``i``."""
    counts = torch.bincount(_ids(output[:first], vocab), minlength=vocab).float().expand(n, vocab).clone()
    for i, token in enumerate(output[first: first + n - 1]):  # proposal i is history from row i + 1 on
        if token < vocab:
            counts[i + 1:, token] += 1
    return counts


def _ids(tokens: Sequence[int], vocab: int) -> torch.Tensor:
    return torch.tensor([t for t in tokens if t < vocab], dtype=torch.long)
