"""vLLM's sampling extras and OpenAI's penalties, and log probabilities, on the lossless engine.

Each processor is checked three ways, with the tiny random models of ``test_lossless_engine``:
- by hand: :func:`apply_processors` against a plain-Python reading of vLLM's definitions;
- sampling: 2-token continuations of the speculative engine (k = 2, a draft model that ignores the
  processors) against the processed target's exact distribution, enumerated through the by-hand
  reference one token at a time (chi-square, N = 2000, seeds 20000.., p-value > 1e-3);
- greedy: speculative output token-identical to the target alone with the same processors.

Log probabilities: speculative decoding reports the target alone's, to float round-off, and the
prompt's equal one plain forward's, whatever the prefill chunking.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from onlinespec.decoding.autoregressive import autoregressive_decoder
from onlinespec.decoding.processors import apply_processors
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams, logits_to_probs
from onlinespec.decoding.speculative import SpeculativeDecoder

pytestmark = pytest.mark.usefixtures("one_thread")

N_RUNS = 2000
NEW_TOKENS = 2  # the first round proposes one token: row 1 of its block has a proposal in its history
SEED_BASE = 20_000
PASS_P = 1e-3
PROMPT = [1, 4, 2]
STOP = 3  # the stop token of the min_tokens case (the tiny models have no EOS)

EACH = {
    "min_p": dict(min_p=0.15),
    "repetition_penalty": dict(repetition_penalty=1.8),
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=-1.2),
    "logit_bias": dict(logit_bias=((0, 2.5), (5, -4.0))),
    "min_tokens": dict(min_tokens=2, stop_token_ids=(STOP,)),
    "top_k -1 and all": dict(min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
                            logit_bias=((2, 1.0),), min_tokens=1, stop_token_ids=(STOP,)),
}


def by_hand(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """vLLM's processors, one row, in plain Python: bias, min_tokens, repetition (prompt and
    output), then presence and frequency (output only)."""
    out = list(logits)
    for token, bias in params.logit_bias:
        out[token] += bias
    if len(output) < params.min_tokens:
        for token in params.stop_token_ids:
            out[token] = -math.inf
    for token in range(len(out)):
        count = output.count(token)
        if params.repetition_penalty != 1.0 and (count or token in prompt):
            out[token] = out[token] / params.repetition_penalty if out[token] > 0 else out[token] * params.repetition_penalty
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


@torch.inference_mode()
def exact_distribution(target, prompt: list[int], params: SamplingParams) -> dict:
    """P(continuation) of every ``NEW_TOKENS``-token continuation under the processed target, one token at a time."""
    dist = {(): 1.0}
    for _ in range(NEW_TOKENS):
        prefixes = list(dist)
        logits = target(input_ids=torch.tensor([prompt + list(x) for x in prefixes])).logits[:, -1]
        rows = torch.tensor([by_hand(logits[i].tolist(), params, prompt, list(x)) for i, x in enumerate(prefixes)])
        probs = logits_to_probs(rows, params).double()
        dist = {x + (t,): dist[x] * float(probs[i, t]) for i, x in enumerate(prefixes) for t in range(probs.shape[-1])}
    return dist


@pytest.mark.parametrize("extra", list(EACH.values()), ids=list(EACH))
def test_processors_by_hand(extra):
    torch.manual_seed(0)
    logits = torch.randn(4, 6) * 3
    params = SamplingParams(**extra)
    output = [0, 5, 0, 2, 4]  # two out already, then three proposals
    got = apply_processors(logits, params, PROMPT, output, 2, {STOP})
    for i in range(4):
        want = by_hand(logits[i].tolist(), params, PROMPT, output[: 2 + i])
        assert got[i].tolist() == pytest.approx(want, rel=1e-6), i


@pytest.mark.parametrize("extra", list(EACH.values()), ids=list(EACH))
def test_sampling_follows_the_processed_target(tiny_target, tiny_draft, extra, chi_square):
    """Speculative sampling with each processor on ~ the processed target. N = 2000, p > 1e-3."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=0, **extra)
    exact = exact_distribution(tiny_target, PROMPT, params)
    decoder = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=2)
    counts: dict[tuple, int] = {}
    rejected = 0
    for i in range(N_RUNS):
        out = decoder.generate(PROMPT, replace(params, seed=SEED_BASE + i, ignore_eos=True))
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        rejected += out.stats.rejected
    assert rejected > N_RUNS / 10  # the draft (blind to the processors) is rejected often: the residual path ran
    assert sum(c for x, c in counts.items() if exact.get(x, 0.0) == 0) == 0, "emitted a continuation the processed target rules out"
    keys = sorted(set(exact) | set(counts))
    p_value, stat, df = chi_square([counts.get(x, 0) for x in keys], [exact.get(x, 0.0) for x in keys])
    assert p_value > PASS_P, (p_value, stat, df)


def test_the_harness_tells_a_processor_from_none(tiny_target, tiny_draft, chi_square):
    """Power: output sampled without the logit bias fails the biased distribution (p < 1e-6, N = 1000)."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, **EACH["logit_bias"])
    exact = exact_distribution(tiny_target, PROMPT, params)
    decoder = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=2)
    counts: dict[tuple, int] = {}
    for i in range(N_RUNS // 2):
        out = decoder.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=SEED_BASE + i, ignore_eos=True))
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    keys = sorted(set(exact) | set(counts))
    assert chi_square([counts.get(x, 0) for x in keys], [exact.get(x, 0.0) for x in keys])[0] < 1e-6


@pytest.mark.parametrize("extra", list(EACH.values()), ids=list(EACH))
def test_greedy_with_processors_equals_the_target_alone(tiny_target, tiny_draft, extra):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, **extra)
    alone = autoregressive_decoder(tiny_target)
    speculative = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=3)
    plain = SamplingParams(max_new_tokens=16, ignore_eos=True)
    changed = 0
    for prompt in ([0], [3, 3], [1, 4, 2, 5], [2, 0, 1, 2, 0, 1, 2]):
        expected = alone.generate(prompt, params)
        assert speculative.generate(prompt, params).token_ids == expected.token_ids, prompt
        changed += expected.token_ids != alone.generate(prompt, plain).token_ids
        if params.min_tokens:
            assert STOP not in expected.token_ids[: params.min_tokens]
    assert changed or extra == EACH["min_p"]  # the processor changed the greedy output (min_p never does)


def test_stop_token_ids_end_the_request(tiny_target):
    alone = autoregressive_decoder(tiny_target)
    free = alone.generate([1, 4, 2, 5], SamplingParams(max_new_tokens=16, ignore_eos=True))
    stop = free.token_ids[3]
    out = alone.generate([1, 4, 2, 5], SamplingParams(max_new_tokens=16, ignore_eos=True, stop_token_ids=(stop,)))
    cut = free.token_ids.index(stop)
    assert out.token_ids == free.token_ids[: cut + 1] and out.stats.finish_reason == "stop"


# ---- log probabilities ----------------------------------------------------------------------------


@torch.inference_mode()
def forward_logprobs(target, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: one plain forward's log-softmax at every position."""
    return target(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_target_alones(tiny_target, tiny_draft, temperature):
    """Each new token's log probability and top alternatives: one forward of the target over the
    text gives the same (1e-5), speculative or not; the prompt's too, chunked or not."""
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=7, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    prompt = [2, 0, 1, 2, 0, 1, 2, 5, 4]
    draft = tiny_target if temperature == 0 else tiny_draft  # greedy: the target drafting for itself, rounds of 4 tokens
    speculative = SpeculativeDecoder(tiny_target, None, DraftModelProposer(draft), k=3, prefill_chunk=4)
    out = speculative.generate(prompt, params)
    if temperature == 0:
        assert out.token_ids == autoregressive_decoder(tiny_target).generate(prompt, params).token_ids
    assert out.stats.accepted > 0
    reference = forward_logprobs(tiny_target, prompt + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    scored = [*out.prompt_logprobs[1:], *out.logprobs]
    for position, x in enumerate(scored):  # the token at position + 1, scored by the row at position
        row = reference[position]
        assert x.token == (prompt + out.token_ids)[position + 1]
        assert x.logprob == pytest.approx(float(row[x.token]), abs=1e-5)
        assert x.rank == 1 + int((row > row[x.token]).sum())
        best = row.topk(len(x.top))
        assert [t for t, _ in x.top] == best.indices.tolist()
    assert all(len(x.top) == 3 for x in out.logprobs) and all(len(x.top) == 2 for x in out.prompt_logprobs[1:])
    if temperature == 0:
        assert all(x.rank == 1 for x in out.logprobs)
