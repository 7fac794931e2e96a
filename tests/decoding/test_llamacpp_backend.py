"""The llama.cpp backend on the packaged GGUF target (as shipped, Q4_1): lossless, and its cache
bookkeeping right.

Greedy: speculative decoding on llama.cpp is token-identical to llama.cpp's target alone, on 12
real prompts, one at a time and 4 in flight; a divergence is tolerated only at a near-tie
(``NEAR_TIE["gguf"]``: a verification block runs other kernels than a one-token decode).

Sampling: 2-token continuations of a repetitive prompt (n-gram proposals, so rejection sampling
runs; most requests start from another's cells of the prompt) against the exact distribution
computed from llama.cpp's own logits of the whole prompt; chi-square, N = 400, seeds 20000..,
p-value > 1e-3, and no continuation the target rules out.
"""

from __future__ import annotations

import pytest
import torch

from onlinespec.backends import resolve_backend, resolve_device
from onlinespec.benchmark import NEAR_TIE, divergence_gap
from onlinespec.data import packaged_prompts
from onlinespec.decoding.proposers.ngram import NgramProposer
from onlinespec.decoding.runners.llamacpp import LlamaCppError
from onlinespec.decoding.sampling import SamplingParams, logits_to_probs
from onlinespec.factory import engine_options, make_proposer, new_decoder
from onlinespec.models import load_target

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def target():
    loaded = load_target("default", backend="auto", device="cpu")
    assert loaded.backend == "llama.cpp", "a GGUF target on a CPU runs on llama.cpp by default"
    return loaded


@pytest.fixture(scope="module")
def prompts():
    return [list(q.messages) for q in packaged_prompts(12, seed=11)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    alone = new_decoder(target, None, 0)
    return [alone.generate(p, SamplingParams(max_new_tokens=NEW_TOKENS)).token_ids for p in prompts]


def check_identical(target, prompts, reference, outputs, label):
    diverged = 0
    for prompt, expected, out in zip(prompts, reference, outputs):
        if out.token_ids != expected:
            diverged += 1
            gap = divergence_gap(target, out.prompt_ids, expected, out.token_ids)
            assert gap <= NEAR_TIE["gguf"], f"{label}: greedy output diverged where the target was not near a tie (gap {gap:.3f})"
    assert diverged <= 1, f"{label}: {diverged} of {len(prompts)} outputs diverged (near-ties, but more than one is suspicious)"


@pytest.mark.parametrize("draft, k, adaptive", [("hybrid", 4, True), ("ngram", 3, False)])
def test_greedy_speculative_is_identical_on_llamacpp(target, prompts, reference, draft, k, adaptive):
    options = engine_options(target, k, adaptive=True, max_batch=4) if adaptive else {}
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    one = new_decoder(target, make_proposer(draft, target).proposer, k, options)
    check_identical(target, prompts, reference, [one.generate(p, params) for p in prompts], f"{draft} alone")
    batched = new_decoder(target, make_proposer(draft, target).proposer, k, options, max_batch=4)
    outputs = batched.generate_many(prompts, params)
    check_identical(target, prompts, reference, outputs, f"{draft} 4 in flight")
    if not adaptive:  # fixed k: every round verified k + 1 tokens, so wide blocks did run
        assert sum(o.stats.proposed for o in outputs) > 0


def test_a_gguf_draft_model_drafts_beside_the_target_and_stays_lossless(target, prompts, reference):
    """A draft model run by llama.cpp (here the target's own file: it should be accepted almost
    always), its cache per request kept in step with what verification kept; 4 requests in flight
    on 2 draft sequences, so that requests lose their draft cache and prefill it again."""
    from onlinespec.decoding.proposers.llamacpp_draft import LlamaCppDraftProposer
    from onlinespec.models import default_gguf_path

    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    one = new_decoder(target, make_proposer(str(default_gguf_path()), target).proposer, 3)
    outputs = [one.generate(p, params) for p in prompts[:6]]
    check_identical(target, prompts[:6], reference[:6], outputs, "GGUF draft alone")
    batched = new_decoder(target, LlamaCppDraftProposer(default_gguf_path(), max_rows=2), 3, max_batch=4)
    outputs += batched.generate_many(prompts[6:], params)
    check_identical(target, prompts[6:], reference[6:], outputs[6:], "GGUF draft, 4 in flight on 2 draft sequences")
    proposed, accepted = sum(o.stats.proposed for o in outputs), sum(o.stats.accepted for o in outputs)
    assert proposed > 0 and accepted / proposed > 0.8, (accepted, proposed)  # its own file: a draft cache out of step would not be


@torch.inference_mode()
def test_weights_read_without_mapping_the_file_compute_the_same_logits(target):
    from onlinespec.decoding.runners.llamacpp import LlamaCppModel, LlamaCppRunner

    prompt, row = target.tokenizer("def reverse(items):\n    return").input_ids, object()
    read = LlamaCppRunner(LlamaCppModel.load(target.gguf, mmap=False), max_rows=1)  # llama.cpp's --no-mmap
    mapped = target.runner(1)
    assert torch.equal(read.forward_alone(row, prompt, 2)[0], mapped.forward_alone(row, prompt, 2)[0])


def test_a_gguf_draft_needs_a_target_served_on_llamacpp(target, tiny_target_folder):
    from onlinespec.models import default_gguf_path, load_model

    with pytest.raises(ValueError, match="on llama.cpp"):
        make_proposer(str(default_gguf_path()), load_model(str(tiny_target_folder)))


@torch.inference_mode()
def test_sampling_follows_llamacpp_target_distribution(target, chi_square):
    # 20 tokens: past MIN_SHARED_PREFILL, so most requests copy an earlier one's cells of the prompt
    # (``fork``) and sample from logits over copied cells (3x faster than 400 prefills of their own)
    prompt = target.tokenizer("one two three " * 6 + "one two").input_ids
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=3, ignore_eos=True)
    runner, row = target.runner(1), object()
    first = logits_to_probs(runner.forward_alone(row, prompt, 1)[0][-1], params).double()
    runner.release([row])
    exact = {}
    for t1 in torch.nonzero(first).flatten().tolist():
        runner, row = target.runner(1), object()
        second = logits_to_probs(runner.forward_alone(row, prompt + [t1], 1)[0][-1], params).double()
        runner.release([row])
        exact.update({(t1, t2): float(first[t1] * second[t2]) for t2 in torch.nonzero(second).flatten().tolist()})
    decoder = new_decoder(target, NgramProposer(max_ngram=3), 3, max_batch=8)
    n = 400  # 9 outcomes (top-k 3, two tokens), the rarest at 3%: 13 expected
    runs = decoder.generate_many([prompt] * n, [SamplingParams(max_new_tokens=2, temperature=1.0, top_k=3, ignore_eos=True, seed=20_000 + i)
                                                for i in range(n)])
    counts: dict[tuple, int] = {}
    for out in runs:
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert sum(o.stats.rejected for o in runs) > n / 20 and sum(o.stats.accepted for o in runs) > n / 20, "rejection sampling did not run"
    assert decoder.engine.shared_prefill_tokens > n * (len(prompt) - 1) / 2, "the requests did not share the prompt's cells"
    assert sum(c for x, c in counts.items() if exact.get(x, 0.0) == 0) == 0, "emitted a continuation the target rules out"
    keys = sorted(set(exact) | set(counts))
    p_value, stat, df = chi_square([counts.get(x, 0) for x in keys], [exact.get(x, 0.0) for x in keys])
    assert p_value > 1e-3, (p_value, stat, df)


@torch.inference_mode()
def test_choices_of_one_prompt_share_its_prefill(target):
    """A request whose prompt another holds copies that cache (``fork``) instead of computing it:
    the next forward reads the same as after a prefill of its own, and ``n`` choices of one
    prompt decode as each would alone (greedy: identical; near-ties aside)."""
    prompt = target.tokenizer("Write two short lines about the sea, the sky, the gulls and the wind that blows over the cold grey water at dawn.").input_ids
    runner, donor, child = target.runner(2), object(), object()
    runner.forward_alone(donor, prompt, 1)
    runner.join(donor, len(prompt))
    assert runner.fork(donor, child, len(prompt) - 1) and not runner.fork(donor, child, len(prompt) - 1)
    forked, _ = runner.forward_alone(child, prompt[-1:] + [11, 12], 3)
    fresh, other = target.runner(1), object()
    expected, _ = fresh.forward_alone(other, prompt + [11, 12], 3)
    assert torch.allclose(forked, expected, atol=0.05), float((forked - expected).abs().max())

    decoder = new_decoder(target, None, 0, max_batch=4)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outputs = decoder.generate_many([prompt] * 4, params)
    assert decoder.engine.shared_prefill_tokens >= 3 * (len(prompt) - 1)
    alone = new_decoder(target, None, 0).generate(prompt, params).token_ids
    assert all(out.token_ids == alone for out in outputs)


@torch.inference_mode()
def test_commit_keeps_only_the_accepted_positions(target):
    """After a 4-token block of which 2 are kept, the next forward reads exactly the prompt and
    those 2 tokens: its logits match a request that prefilled them alone."""
    prompt = target.tokenizer("The capital of France is").input_ids
    runner, row = target.runner(2), object()
    runner.forward_alone(row, prompt, 1)
    runner.join(row, len(prompt))
    runner.forward([[11, 12, 13, 14]])
    runner.commit([2])
    logits, hidden = runner.forward([[15]])
    fresh, other = target.runner(1), object()
    expected, expected_hidden = fresh.forward_alone(other, prompt + [11, 12, 15], 1)
    assert torch.allclose(logits[0][-1], expected[-1], atol=0.05), float((logits[0][-1] - expected[-1]).abs().max())
    assert hidden[0].shape == (1, target.model.config.hidden_size)
    assert torch.nn.functional.cosine_similarity(hidden[0][-1], expected_hidden[-1], dim=0) > 0.999


def test_rows_out_of_sequence_order_get_their_own_outputs(target):
    """The runner hands llama.cpp a step's blocks in sequence-id order (one graph, not one per
    row): each row still gets its own logits back, whatever order the engine's rows are in, and
    a request that arrives after others left takes the lowest free sequence."""
    texts = ["The capital of France is", "def add(a, b):", "Twelve times three is"]
    prompts = [target.tokenizer(text).input_ids for text in texts]
    runner, rows = target.runner(3), [object(), object(), object()]
    for row, prompt in zip(rows, prompts):
        runner.forward_alone(row, prompt, 1)
    runner.release(rows[:1])  # the first to arrive leaves; a new one takes its sequence, id 0
    rows[0] = object()
    runner.forward_alone(rows[0], prompts[0], 1)
    order = [2, 0, 1]  # the engine's rows: not in sequence-id order
    for i in order:
        runner.join(rows[i], len(prompts[i]))
    blocks = {0: [11, 12], 1: [13], 2: [14, 15, 16]}
    logits, _ = runner.forward([blocks[i] for i in order])
    for got, i in zip(logits, order):
        alone, row = target.runner(1), object()
        expected, _ = alone.forward_alone(row, prompts[i] + blocks[i], len(blocks[i]))
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=0.05), (texts[i], float((got - expected).abs().max()))
    assert runner._seq[id(rows[0])] == 0


def test_sequences_are_released_and_bounded(target):
    runner = target.runner(2)
    rows = [object(), object()]
    for row in rows:
        runner.prefill(row, [1, 2, 3])
    with pytest.raises(LlamaCppError, match="sequences are in use"):
        runner.prefill(object(), [1, 2, 3])
    runner.release(rows[:1])
    runner.prefill(object(), [1, 2, 3])  # the freed sequence is reused
    assert len(runner.holding()) == 2


def test_backend_choice_says_what_to_fix():
    assert resolve_backend("auto", gguf=False, device="cpu") == "torch"
    with pytest.raises(ValueError, match="runs GGUF files"):
        resolve_backend("llama.cpp", gguf=False, device="cpu")
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("vllm", gguf=True, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
        assert resolve_device("auto") == "cpu"


@pytest.fixture(scope="module")
def shipped_target():
    """The packaged file as shipped (Q4_1), whatever format this machine chose to serve: the
    decode share bounds *time*, and the step counts below were set where a batch row costs nearly
    a step of its own, as on Q4_1; Q8_0's batched kernels make B's rows cheaper, so the same time
    share buys B more steps there."""
    return load_target("default", backend="auto", device="cpu", target_format="as-is")


def test_a_tenant_over_its_share_sits_steps_out_and_every_answer_stays_the_targets(shipped_target):
    """Issue 46: on a CPU a batch row costs nearly a step of its own, so tenant B's 16-choice
    requests at their share of the slots doubled tenant A's time per token (the abuse benchmark,
    docs/reliability.md). Now a tenant over its share of the slots (choices waiting) gets at most
    ``held_share`` of the decode time while a tenant within its share decodes: its rows sit the
    other steps out, their caches kept. Every answer is still the target's (greedy, batch effect
    and near-ties aside), B's choices all finish, and A's request decodes in every step."""
    from onlinespec.decoding.scheduler import FairScheduler

    decoder = new_decoder(shipped_target, None, 0, max_batch=4)
    scheduler = FairScheduler(decoder.engine, max_batch=4, held_share=0.4)
    a_prompt = [{"role": "user", "content": "Write a short poem about the sea."}]
    b_prompt = shipped_target.tokenizer("Once upon a time").input_ids  # short: a held tenant prefills a row's block a step
    a_params, b_params = SamplingParams(max_new_tokens=64, ignore_eos=True), SamplingParams(max_new_tokens=12, ignore_eos=True)
    a = scheduler.submit(decoder.request(a_prompt, a_params), tenant="A", group="a")
    b = [scheduler.submit(decoder.request(b_prompt, b_params), tenant="B", group="b") for _ in range(6)]
    a_decoded = b_decoded = contested = 0
    while scheduler.has_work:
        before = {id(r): len(r.stop.generated) for r in [a, *b]}
        rows = {id(r) for r in decoder.engine.runner.rows}
        scheduler.step()
        if id(a) in rows and not a.finished:
            a_decoded += len(a.stop.generated) > before[id(a)]
            if any(id(r) in rows for r in b):
                contested += 1
                b_decoded += any(len(r.stop.generated) > before[id(r)] for r in b if id(r) in rows)
    assert a_decoded and scheduler.decode_share.sat_out > 0 and contested > 0
    assert b_decoded <= contested / 2  # before: B's rows decoded in every step beside A's (3 rows to A's 1)
    assert b_decoded >= contested / 8  # and B is not starved of them
    assert all(r.finished and r.error is None for r in [a, *b])
    alone = new_decoder(shipped_target, None, 0)
    for r, prompt, params in [(a, a_prompt, a_params)] + [(r, b_prompt, b_params) for r in b]:
        expected = alone.generate(prompt, params).token_ids
        if r.stop.generated != expected:  # llama.cpp's batch effect: only at a near-tie
            assert divergence_gap(shipped_target, r.prompt_ids, expected, r.stop.generated) <= NEAR_TIE["gguf"]
