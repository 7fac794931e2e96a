"""The bulk warm-up's accelerator work (:mod:`onlinespec.drafts.bulk`): decode the target's answers
to each :class:`Job` in batches that fit a token budget (halving a batch that runs out of memory),
then score every sequence teacher-forced for the target's features and top-K distributions."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from onlinespec.distill.signal import Signal


@dataclass(frozen=True)
class Job:
    """One batch of decoding work: ``samples`` continuations of each prompt at ``temperature``
    (0: the single greedy answer)."""

    name: str
    temperature: float
    samples: int
    max_new_tokens: int
    prompts: list[list[int]] = field(repr=False)
    domains: list[str] = field(repr=False)
    query_ids: list[str] = field(repr=False)


def _batches(order: list[int], lengths: list[int], extra: int, token_budget: int, max_rows: int):
    """Slices of ``order`` (longest first) whose padded size stays under ``token_budget``."""
    batch: list[int] = []
    for i in order:
        width = lengths[batch[0] if batch else i] + extra  # the first of a batch is its longest
        if batch and (width * (len(batch) + 1) > token_budget or len(batch) >= max_rows):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


@torch.inference_mode()
def _generate(model, prompts: list[list[int]], job: Job, eos_ids: list[int], pad_id: int) -> list[list[int]]:
    """The new tokens of each left-padded prompt (padding after EOS included)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    sampling = {"do_sample": True, "temperature": job.temperature, "top_k": 0, "top_p": 1.0} if job.temperature > 0 else {"do_sample": False}
    return model.generate(
        input_ids=ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=job.max_new_tokens,
        eos_token_id=eos_ids, pad_token_id=pad_id, **sampling,
    )[:, width:].tolist()


@torch.inference_mode()
def decode(model, job: Job, eos_ids: list[int], pad_id: int, token_budget: int, max_rows: int, deadline: float, log=print) -> list[tuple[list[int], int, str, str]]:
    """The target's continuations of ``job``: ``(prompt + answer ids, prompt length, domain, id)``
    per sample, longest prompts first; stops starting batches once ``deadline`` has passed."""
    items = [(p, d, f"{q}#s{s}" if job.samples > 1 else q) for s in range(job.samples) for p, d, q in zip(job.prompts, job.domains, job.query_ids)]
    lengths = [len(p) for p, _, _ in items]
    order = sorted(range(len(items)), key=lambda i: -lengths[i])
    out = []
    pending = list(_batches(order, lengths, job.max_new_tokens, token_budget, max_rows))
    while pending:
        batch = pending.pop(0)
        if time.monotonic() > deadline:
            log(f"  {job.name}: deadline reached after {len(out)}/{len(items)} sequences")
            break
        try:
            generated = _generate(model, [items[i][0] for i in batch], job, eos_ids, pad_id)
        except torch.cuda.OutOfMemoryError:
            if len(batch) == 1:
                raise
            torch.cuda.empty_cache()
            log(f"  {job.name}: out of memory at {len(batch)} rows, halving")
            pending[:0] = [batch[: len(batch) // 2], batch[len(batch) // 2:]]
            continue
        stop = set(eos_ids)
        for r, i in enumerate(batch):
            answer = generated[r]
            end = next((n + 1 for n, t in enumerate(answer) if t in stop), len(answer))
            prompt, domain, qid = items[i]
            out.append((list(prompt) + answer[:end], len(prompt), domain, qid))
    return out


@torch.inference_mode()
def score(model, sequences: list[tuple[list[int], int, str, str]], top_k: int = 32, token_budget: int = 131072, logit_rows: int = 16384) -> Signal:
    """Teacher-forced pass over each sequence: the target's post-norm feature at every token and
    its top-K log-probabilities for the next one (a :class:`Signal` on the model's device)."""
    device = model.device
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    lengths = [len(s[0]) for s in sequences]
    order = sorted(range(len(sequences)), key=lambda i: -lengths[i])
    rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for batch in _batches(order, lengths, 0, token_budget, 4096):
        width = max(lengths[i] for i in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):  # right padding: causal attention keeps the real tokens exact
            ids[r, : lengths[i]] = torch.tensor(sequences[i][0])
        hidden = decoder(input_ids=ids.to(device)).last_hidden_state
        valid = torch.cat([hidden[r, : lengths[i]] for r, i in enumerate(batch)])
        tops = [torch.log_softmax(head(valid[a: a + logit_rows]).float(), -1).topk(top_k, dim=-1) for a in range(0, len(valid), logit_rows)]
        top_ids, top_lp = torch.cat([t.indices for t in tops]), torch.cat([t.values for t in tops])
        first = 0
        for i in batch:
            n = lengths[i]
            rows[i] = (valid[first: first + n].half(), top_ids[first: first + n], top_lp[first: first + n])
            first += n
    every = range(len(sequences))
    return Signal(
        torch.tensor([t for ids, *_ in sequences for t in ids], device=device),
        torch.cat([rows[i][0] for i in every]), torch.cat([rows[i][1] for i in every]), torch.cat([rows[i][2] for i in every]),
        torch.cat([torch.zeros(1, dtype=torch.long, device=device), torch.tensor(lengths, device=device).cumsum(0)]),
        torch.tensor([s[1] for s in sequences], device=device),
        [s[2] for s in sequences], [s[3] for s in sequences],
    )
