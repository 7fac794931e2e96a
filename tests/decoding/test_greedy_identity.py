"""Greedy speculative decoding is token-identical to the target alone, on the real default model
run by the torch backend (the path a GPU serves; the llama.cpp backend has its own test in
test_llamacpp_backend.py, and bench/backends.py checks 60 held-out prompts).

9 real prompts (3 chat, 3 code, 3 math) from the packaged data sets, fp32. Verifying k + 1
tokens in one forward pass rounds differently in the last bits from one token per pass, so a
divergence is tolerated only where the target's two best logits are within NEAR_TIE of each
other; the test checks that every divergence is such a near-tie.
"""

import pytest
import torch

from onlinespec.benchmark import NEAR_TIE, divergence_gap
from onlinespec.data import packaged_prompts
from onlinespec.decoding.autoregressive import autoregressive_decoder
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.factory import engine_options, make_proposer
from onlinespec.models import load_model

pytestmark = pytest.mark.slow
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def target():
    return load_model("default", "float32")


@pytest.fixture(scope="module")
def prompts():
    queries = packaged_prompts(9, seed=7)
    assert {q.domain for q in queries} == {"chat", "code", "math"}
    return [list(q.messages) for q in queries]


@pytest.fixture(scope="module")
def reference(target, prompts):
    decoder = autoregressive_decoder(target.model, target.tokenizer)
    return [decoder.generate(p, SamplingParams(max_new_tokens=MAX_NEW_TOKENS)).token_ids for p in prompts]


def test_target_alone_matches_hf_generate(target, prompts, reference):
    for prompt, ours in list(zip(prompts, reference))[:4]:
        ids = target.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"]
        with torch.inference_mode():
            hf = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        assert hf[0, len(ids):].tolist() == ours


@pytest.mark.parametrize("draft, k, adaptive, every", [("ngram", 4, False, 1), ("target-layers:4", 3, False, 3), ("hybrid", 4, True, 1),
                                                       ("head", 3, False, 1)])
def test_greedy_speculative_is_identical(target, prompts, reference, draft, k, adaptive, every):
    """``hybrid`` / ``head``: the packaged feature head (features read from the verification pass),
    with the adaptive-k policy on the measured verify-cost curve for ``hybrid``. The draft LM
    (4 of the target's layers, the slowest to run on a CPU) gets every third prompt."""
    # the curve over batch sizes 1-4 the batched test below reads too: one calibration, not two
    options = engine_options(target, k, pad=True, adaptive=True, max_batch=4) if adaptive else {}
    decoder = SpeculativeDecoder(target.model, target.tokenizer, make_proposer(draft, target).proposer, k=k, **options)
    accepted = 0
    for prompt, expected in list(zip(prompts, reference))[::every]:
        out = decoder.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
        accepted += out.stats.accepted
        if out.token_ids != expected:
            gap = divergence_gap(target, out.prompt_ids, expected, out.token_ids)
            assert gap <= NEAR_TIE["float32"], f"greedy output diverged where the target was not near a tie (gap {gap})"
    assert accepted > 0, "no proposal was ever accepted: the test would not exercise multi-token rounds"


def test_greedy_speculative_is_identical_when_batched(target, prompts, reference):
    """The default draft (hybrid, adaptive k on the measured curve over batch sizes 1-4), the 9
    prompts served 4 at a time: every request's output is the target alone's (near-tie rule),
    and the target alone batched the same way equals itself one at a time."""
    options = engine_options(target, 4, pad=True, adaptive=True, max_batch=4)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    decoders = {
        "hybrid": SpeculativeDecoder(target.model, target.tokenizer, make_proposer("hybrid", target).proposer, k=4, **options),
        "target alone": SpeculativeDecoder(target.model, target.tokenizer, None, cost_curve=options["cost_curve"]),
    }
    accepted = {}
    for name, decoder in decoders.items():
        outs = decoder.generate_many(prompts, params, max_batch=4)
        accepted[name] = sum(o.stats.accepted for o in outs)
        for out, expected in zip(outs, reference):
            if out.token_ids != expected:
                gap = divergence_gap(target, out.prompt_ids, expected, out.token_ids)
                assert gap <= NEAR_TIE["float32"], f"{name}: batched greedy output diverged where the target was not near a tie (gap {gap})"
    assert accepted["hybrid"] > 0, "no proposal was ever accepted: the test would not exercise multi-token rounds"
