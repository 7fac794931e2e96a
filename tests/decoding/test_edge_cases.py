"""Edge cases of the speculative loop: k = 1, EOS and max_new_tokens inside a block, stop strings
across rounds, empty prompts, streaming, traces. Tiny random models; a scripted proposer when the
test needs to control exactly what is proposed."""

from __future__ import annotations

import pytest
import torch

from onlinespec.decoding.autoregressive import autoregressive_decoder
from onlinespec.decoding.proposers.base import PerRequestProposer, Proposal
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams, logits_to_probs
from onlinespec.decoding.speculative import RequestFailed, RoundTrace, SpeculativeDecoder

pytestmark = pytest.mark.usefixtures("one_thread")


class ScriptedProposer(PerRequestProposer):
    """Proposes ``script[len(ids) : len(ids) + k]`` (point masses); records every call.

    ``wrong``: absolute positions where it proposes a wrong token instead (to force rejections).
    ``extra``: proposes this many tokens MORE than asked (a misbehaving proposer).
    """

    name = "scripted"

    def __init__(self, script: list[int], vocab: int, wrong: set[int] = frozenset(), extra: int = 0):
        self.script, self.vocab, self.wrong, self.extra = script, vocab, set(wrong), extra
        self.calls: list[tuple[int, int]] = []  # (len(ids), k) per propose call
        self.begun = 0

    def start(self, prompt_ids):
        self.begun += 1

    def propose_one(self, d):
        ids, k = d.ids, d.k
        self.calls.append((len(ids), k))
        start = len(ids)
        tokens = []
        for pos in range(start, min(start + k + self.extra, len(self.script))):
            token = self.script[pos]
            tokens.append((token + 1) % self.vocab if pos in self.wrong else token)
        return Proposal(tokens)


def greedy_reference(target, prompt, n, tokenizer=None):
    """Target-alone greedy continuation of ``n`` tokens, ignoring EOS."""
    return autoregressive_decoder(target, tokenizer).generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)).token_ids


# ---- k = 1 ---------------------------------------------------------------------------------------------


def test_k1_rounds_propose_one_token(tiny_target):
    prompt = [2, 5, 1]
    ref = greedy_reference(tiny_target, prompt, 12)
    wrong = {len(prompt) + 2, len(prompt) + 5}  # both get proposed (see the round layout below)
    proposer = ScriptedProposer(prompt + ref, vocab=6, wrong=wrong)
    out = SpeculativeDecoder(tiny_target, None, proposer, k=1).generate(prompt, SamplingParams(max_new_tokens=12))
    assert out.token_ids == ref
    assert all(k == 1 for _, k in proposer.calls)
    # rounds start at offsets 0 (2 tokens), 2 (wrong: 1 token), 3 (2), 5 (wrong: 1), 6, 8, 10
    assert [n - len(prompt) for n, _ in proposer.calls] == [0, 2, 3, 5, 6, 8, 10]
    assert out.stats.rejected == 2 and out.stats.proposed == len(proposer.calls)
    assert out.stats.accepted + out.stats.rounds == 12


def test_k1_with_a_draft_model_when_sampling(tiny_target, tiny_draft):
    decoder = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=1)
    out = decoder.generate([1, 2], SamplingParams(max_new_tokens=15, temperature=1.0, seed=4, ignore_eos=True))
    assert len(out.token_ids) == 15 and out.stats.finish_reason == "length"
    assert out.stats.proposed <= out.stats.rounds  # at most one proposal per round


# ---- EOS inside a block -------------------------------------------------------------------------------


def counting_llama(tiny_llama, eos_token_id: int | None = None):
    """A tiny Llama rewired so its greedy continuation of token t is (t + 1) mod 6: prompt [0] gives
    1, 2, 3, 4, 5, 0, 1, ... -- every token's first position is known, so EOS can be put anywhere.
    (Attention and MLP outputs zeroed, one-hot embeddings, a shifted identity as output head.)"""
    model = tiny_llama(0, eos_token_id=eos_token_id)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[range(6), range(6)] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[range(6), [(j - 1) % 6 for j in range(6)]] = 2.0
    return model


def test_counting_llama_counts(tiny_llama):
    assert greedy_reference(counting_llama(tiny_llama), [0], 8) == [1, 2, 3, 4, 5, 0, 1, 2]


@pytest.mark.parametrize("eos_index", [0, 1, 3, 4], ids=["first", "accepted-mid", "last-proposal", "bonus"])
def test_eos_inside_an_accepted_block_stops_right_there(tiny_llama, eos_index):
    """k = 4, every proposal right: the round emits 5 tokens, but EOS at ``eos_index`` ends the
    request there: nothing after it, finish_reason "eos", the same as decoding without drafts."""
    prompt, ref = [0], [1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    eos = ref[eos_index]
    target = counting_llama(tiny_llama, eos_token_id=eos)
    proposer = ScriptedProposer(prompt + ref, vocab=6)
    out = SpeculativeDecoder(target, None, proposer, k=4).generate(prompt, SamplingParams(max_new_tokens=20))
    assert out.token_ids == ref[: eos_index + 1]
    assert out.stats.finish_reason == "eos"
    assert out.stats.new_tokens == eos_index + 1
    assert out.stats.rounds == 1
    alone = autoregressive_decoder(target).generate(prompt, SamplingParams(max_new_tokens=20))
    assert alone.token_ids == out.token_ids and alone.stats.finish_reason == "eos"
    # ignore_eos: the same EOS token no longer stops anything
    out = SpeculativeDecoder(target, None, ScriptedProposer(prompt + ref, vocab=6), k=4).generate(
        prompt, SamplingParams(max_new_tokens=8, ignore_eos=True)
    )
    assert out.token_ids == ref[:8] and out.stats.finish_reason == "length"


def test_eos_as_the_correction_token(tiny_llama):
    """The proposal at block position 2 is wrong and the target's correction there is EOS (3)."""
    prompt, ref = [0], [1, 2, 3, 4, 5]
    target = counting_llama(tiny_llama, eos_token_id=3)
    proposer = ScriptedProposer(prompt + ref, vocab=6, wrong={3})
    out = SpeculativeDecoder(target, None, proposer, k=4).generate(prompt, SamplingParams(max_new_tokens=20))
    assert out.token_ids == [1, 2, 3] and out.stats.finish_reason == "eos"
    assert out.stats.accepted == 2 and out.stats.rejected == 1


def test_eos_when_sampling(tiny_llama, tiny_target):
    """Sampling: whatever the draft proposes after EOS is dropped; the output ends with EOS."""
    target = tiny_llama(0, eos_token_id=2)  # tiny_target's weights; token 2 is frequent
    decoder = SpeculativeDecoder(target, None, DraftModelProposer(tiny_target), k=4)
    finished = 0
    for seed in range(30):
        out = decoder.generate([0, 1], SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed))
        if out.stats.finish_reason == "eos":
            finished += 1
            assert out.token_ids.index(2) == len(out.token_ids) - 1
        else:
            assert 2 not in out.token_ids and len(out.token_ids) == 30
    assert finished > 0


def test_eos_from_the_tokenizer_when_the_model_has_none(tiny_target, default_tokenizer):
    decoder = SpeculativeDecoder(tiny_target, default_tokenizer, None, k=0)
    assert decoder.eos_token_ids == {default_tokenizer.eos_token_id}


# ---- max_new_tokens inside a block -----------------------------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 7, 11])
@pytest.mark.parametrize("wrong", [set(), {5, 9}], ids=["all-right", "two-wrong"])
def test_max_new_tokens_reached_mid_block(tiny_target, max_new_tokens, wrong):
    """Exactly ``max_new_tokens`` tokens, finish_reason "length", and no proposal is ever asked
    for past the budget: each call's k <= remaining - 1 (so never more than max_new_tokens - 1)."""
    prompt = [3, 1, 4]
    ref = greedy_reference(tiny_target, prompt, max_new_tokens)
    proposer = ScriptedProposer(prompt + ref + [0] * 10, vocab=6, wrong={len(prompt) + w for w in wrong})
    out = SpeculativeDecoder(tiny_target, None, proposer, k=4).generate(prompt, SamplingParams(max_new_tokens=max_new_tokens))
    assert out.token_ids == ref
    assert len(out.token_ids) == max_new_tokens
    assert out.stats.finish_reason == "length" and out.stats.new_tokens == max_new_tokens
    for n_ids, k in proposer.calls:
        generated = n_ids - len(prompt)
        assert 1 <= k <= max_new_tokens - generated - 1
        assert k <= max_new_tokens - 1
    if max_new_tokens == 1:
        assert proposer.calls == []


def test_a_proposer_that_overshoots_k_cannot_overshoot_max_new_tokens(tiny_target):
    """Even a proposer that returns more tokens than asked cannot push past the budget."""
    prompt = [3, 1, 4]
    ref = greedy_reference(tiny_target, prompt, 20)
    proposer = ScriptedProposer(prompt + ref, vocab=6, extra=3)
    out = SpeculativeDecoder(tiny_target, None, proposer, k=2).generate(prompt, SamplingParams(max_new_tokens=7))
    assert out.token_ids == ref[:7] and out.stats.finish_reason == "length"


# ---- stop strings across rounds (real tokenizer, tiny random model with its vocabulary) -------


@pytest.fixture(scope="module")
def tiny_wide(tiny_llama):
    """A tiny random Llama with the default tokenizer's 49152-token vocabulary (EOS id 2)."""
    return tiny_llama(0, vocab_size=49152, eos_token_id=2)


def _stop_across_rounds(model, tokenizer, prompt: str, k: int):
    """A stop string made of the last 3 characters of round 1 and the first 2 of round 2."""
    ref = greedy_reference(model, tokenizer(prompt).input_ids, 2 * (k + 1), tokenizer)
    round1 = tokenizer.decode(ref[: k + 1])
    next_piece = tokenizer.decode(ref[k + 1 : k + 2])
    assert tokenizer.decode(ref[: k + 2]) == round1 + next_piece and len(next_piece) >= 2
    stop = round1[-3:] + next_piece[:2]
    assert stop not in round1
    return ref, round1, stop


@pytest.mark.parametrize("prompt", ["Hello world", "The cat sat on"])
def test_stop_string_spanning_two_rounds(tiny_wide, default_tokenizer, prompt):
    """k = 3, self-drafting (all accepted): round 1 emits 4 tokens, round 2 completes the stop
    string with its first token. Output: text cut right before the stop string, tokens up to the
    one completing it, finish_reason "stop" -- identical to decoding without drafts."""
    k = 3
    ref, round1, stop = _stop_across_rounds(tiny_wide, default_tokenizer, prompt, k)
    params = SamplingParams(max_new_tokens=40, stop_strings=(stop,))
    decoder = SpeculativeDecoder(tiny_wide, default_tokenizer, DraftModelProposer(tiny_wide), k=k)
    out = decoder.generate(prompt, params)
    assert out.stats.finish_reason == "stop"
    assert out.token_ids == ref[: k + 2]
    assert out.text == round1[:-3]
    assert stop not in out.text
    assert out.stats.rounds == 2
    alone = autoregressive_decoder(tiny_wide, default_tokenizer).generate(prompt, params)
    assert (alone.token_ids, alone.text, alone.stats.finish_reason) == (out.token_ids, out.text, "stop")
    # streaming holds back the stop string's first characters: nothing has to be taken back
    chunks = list(decoder.stream(prompt, params))
    assert "".join(c.text for c in chunks) == out.text
    assert chunks[0].text == round1[:-3]


def test_stop_string_inside_an_accepted_block(tiny_wide, default_tokenizer):
    """The stop string ends inside round 1's accepted proposals: the rest of the block is dropped."""
    ids = default_tokenizer("Hello world").input_ids
    ref = greedy_reference(tiny_wide, ids, 6, default_tokenizer)
    second = default_tokenizer.decode(ref[1:2])
    params = SamplingParams(max_new_tokens=40, stop_strings=(second,))
    decoder = SpeculativeDecoder(tiny_wide, default_tokenizer, DraftModelProposer(tiny_wide), k=4)
    out = decoder.generate("Hello world", params)
    assert out.token_ids == ref[:2] and out.stats.finish_reason == "stop"
    assert out.text == default_tokenizer.decode(ref[:1])


# ---- empty prompts, missing tokenizer -------------------------------------------------------------


def test_empty_prompt_is_a_clear_error(tiny_target, tiny_wide, default_tokenizer):
    with pytest.raises(ValueError, match="prompt is empty"):
        SpeculativeDecoder(tiny_target).generate([])
    decoder = SpeculativeDecoder(tiny_wide, default_tokenizer)
    for prompt in ("", []):
        with pytest.raises(ValueError, match="prompt is empty"):
            decoder.generate(prompt)
        with pytest.raises(ValueError, match="prompt is empty"):
            list(decoder.stream(prompt))


def test_text_prompt_without_tokenizer_is_a_clear_error(tiny_target):
    decoder = SpeculativeDecoder(tiny_target)
    with pytest.raises(ValueError, match="no tokenizer"):
        decoder.generate("hello")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        list(decoder.stream([1, 2]))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        decoder.generate([1, 2], SamplingParams(stop_strings=("x",)))
    with pytest.raises(TypeError, match="prompt must be"):
        decoder.generate(42)


# ---- streaming ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=30),
        SamplingParams(max_new_tokens=30, temperature=1.0, seed=11),
        SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=12),
    ],
    ids=["greedy", "sampling", "top-p"],
)
def test_stream_concatenates_to_generate(tiny_wide, default_tokenizer, tiny_llama, params):
    draft = tiny_llama(5, vocab_size=49152, eos_token_id=2)
    decoder = SpeculativeDecoder(tiny_wide, default_tokenizer, DraftModelProposer(draft), k=3)
    out = decoder.generate("Once upon a time", params)
    chunks = list(decoder.stream("Once upon a time", params))
    assert "".join(c.text for c in chunks) == out.text
    assert [t for c in chunks for t in c.token_ids] == out.token_ids
    assert all(c.stats is None for c in chunks[:-1])
    final = chunks[-1].stats
    assert final is not None and final.finish_reason == out.stats.finish_reason
    assert final.new_tokens == len(out.token_ids) and final.rounds == len(chunks) == out.stats.rounds
    assert (final.accepted, final.proposed) == (out.stats.accepted, out.stats.proposed)


# ---- traces ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trace_rounds_are_consistent(tiny_target, tiny_draft, temperature):
    """One RoundTrace per round; ``position`` = len(prompt) + tokens generated before the round;
    the round emitted ``proposals[:n_accepted] + [next_token]``; row i of the target's top
    log-probs is the target's (temperature-1) log-softmax after ``position + i`` tokens."""
    prompt = [1, 4, 2, 0]
    params = SamplingParams(max_new_tokens=25, temperature=temperature, seed=21, ignore_eos=True)
    decoder = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=3)
    out = decoder.generate(prompt, params, trace=True)
    assert len(out.trace) == out.stats.rounds
    assert all(isinstance(t, RoundTrace) for t in out.trace)
    assert sum(t.n_accepted for t in out.trace) == out.stats.accepted
    assert sum(len(t.proposals) for t in out.trace) == out.stats.proposed
    full = prompt + out.token_ids
    generated = 0
    for t in out.trace:
        assert t.position == len(prompt) + generated
        emitted = t.proposals[: t.n_accepted] + [t.next_token]
        assert full[t.position : t.position + len(emitted)] == emitted
        assert t.accepted == [i < t.n_accepted for i in range(len(t.proposals))]
        assert t.target_top_ids.shape == t.target_top_logprobs.shape == (len(t.proposals) + 1, 6)
        if t.proposals:  # a round without proposals (the budget's last token) has no draft probs
            assert t.draft_probs is not None and len(t.draft_probs) == len(t.proposals)
        with torch.no_grad():
            contexts = [full[: t.position] + t.proposals[:i] for i in range(len(t.proposals) + 1)]
            target_rows = torch.stack([tiny_target(input_ids=torch.tensor([c])).logits[0, -1] for c in contexts])
            draft_rows = [tiny_draft(input_ids=torch.tensor([c])).logits[0, -1] for c in contexts[:-1]]
        expected = torch.log_softmax(target_rows, -1).gather(-1, t.target_top_ids)
        torch.testing.assert_close(t.target_top_logprobs, expected, atol=1e-4, rtol=1e-4)
        assert (t.target_top_logprobs[:, :-1] >= t.target_top_logprobs[:, 1:]).all()  # sorted, best first
        for i, x in enumerate(t.proposals):
            # q(x): the distribution x was drawn from; a greedy draft reports temperature 1
            q = draft_rows[i].softmax(-1) if temperature == 0 else logits_to_probs(draft_rows[i], params)
            assert t.draft_probs[i] == pytest.approx(float(q[x]), abs=1e-4)
        generated += len(emitted)
    assert generated == len(out.token_ids)


def test_trace_with_point_mass_proposer_and_off_by_default(tiny_target):
    prompt = [3, 1, 4]
    ref = greedy_reference(tiny_target, prompt, 10)
    proposer = ScriptedProposer(prompt + ref, vocab=6, wrong={len(prompt) + 4})
    decoder = SpeculativeDecoder(tiny_target, None, proposer, k=3, trace_top_k=2)
    out = decoder.generate(prompt, SamplingParams(max_new_tokens=10), trace=True)
    # round 1: 3 right + bonus; round 2: offset 4 wrong, correction only; round 3: 3 right +
    # bonus (9 tokens); round 4: one token left, so no proposal at all
    assert [t.n_accepted for t in out.trace] == [3, 0, 3, 0]
    assert [t.position for t in out.trace] == [3, 7, 8, 12]
    assert [len(t.proposals) for t in out.trace] == [3, 3, 3, 0]
    assert all(t.draft_probs is None for t in out.trace)
    assert out.trace[0].target_top_ids.shape == (4, 2)
    assert decoder.generate(prompt, SamplingParams(max_new_tokens=10)).trace == []


def test_stream_with_partial_characters(tiny_llama, default_tokenizer):
    """Flat random models sample byte tokens now and then (text with U+FFFD while a character is
    incomplete); streamed text still concatenates to exactly generate()'s text. Seeds 0..7."""
    target = tiny_llama(0, vocab_size=49152, eos_token_id=2, head_scale=1.0)
    draft = tiny_llama(5, vocab_size=49152, eos_token_id=2, head_scale=1.0)
    decoder = SpeculativeDecoder(target, default_tokenizer, DraftModelProposer(draft), k=3)
    with_replacement = 0
    for seed in range(8):
        params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed)
        out = decoder.generate("Hi", params)
        with_replacement += "\ufffd" in out.text
        assert "".join(c.text for c in decoder.stream("Hi", params)) == out.text
    assert with_replacement > 0  # the partial-character path was exercised


def test_stream_releases_a_held_back_prefix_that_never_becomes_a_stop_string(tiny_wide, default_tokenizer):
    """Round 1 ends with the first 3 characters of a stop string that never completes: they are
    held back from chunk 1 and released in chunk 2."""
    k = 3
    ref, round1, stop = _stop_across_rounds(tiny_wide, default_tokenizer, "Hello world", k)
    never = round1[-3:] + "\u2603\u2603"  # snowmen: not produced by this model
    params = SamplingParams(max_new_tokens=12, stop_strings=(never,))
    decoder = SpeculativeDecoder(tiny_wide, default_tokenizer, DraftModelProposer(tiny_wide), k=k)
    out = decoder.generate("Hello world", params)
    assert out.stats.finish_reason == "length" and out.token_ids == greedy_reference(
        tiny_wide, default_tokenizer("Hello world").input_ids, 12
    )
    chunks = list(decoder.stream("Hello world", params))
    assert chunks[0].text == round1[:-3]
    assert chunks[1].text.startswith(round1[-3:])
    assert "".join(c.text for c in chunks) == out.text


def test_chat_prompt_uses_the_chat_template(tiny_wide, default_tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    decoder = SpeculativeDecoder(tiny_wide, default_tokenizer, DraftModelProposer(tiny_wide), k=2)
    out = decoder.generate(messages, SamplingParams(max_new_tokens=4))
    expected = default_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_ids == default_tokenizer(expected, add_special_tokens=False).input_ids
    assert len(out.token_ids) == 4 or out.stats.finish_reason == "eos"


# ---- stop strings made of multi-byte characters ------------------------------------------------------


class ForcedTarget(torch.nn.Module):
    """A real tiny Llama (real KV cache) whose logits are overridden to continue ``script``.

    Row j of a forward pass sits at absolute position ``a`` (its position id, or the cache length
    before the call + offset) and predicts ``script[a + 1]`` with certainty; past the script the
    model's own logits remain.
    Lets a test make the target "say" any text, e.g. an emoji that takes three byte tokens.
    """

    def __init__(self, model, script: list[int]):
        super().__init__()
        self.model, self.script = model, script
        self.config, self.generation_config = model.config, model.generation_config

    def forward(self, input_ids, cache=None, logits_to_keep=0, position_ids=None, **kwargs):
        start = cache.get_seq_length() if cache is not None else 0
        out = self.model(input_ids=input_ids, cache=cache, logits_to_keep=logits_to_keep, position_ids=position_ids, **kwargs)
        logits = out.logits.clone()
        rows = logits.shape[1]
        for b in range(logits.shape[0]):
            # absolute position of row 0
            first = int(position_ids[b, -rows]) if position_ids is not None else start + input_ids.shape[1] - rows
            for j in range(rows):
                nxt = first + j + 1
                if nxt < len(self.script):
                    logits[b, j] = -1e4
                    logits[b, j, self.script[nxt]] = 1e4
        out.logits = logits
        return out


def test_forced_target_says_its_script(tiny_wide, default_tokenizer):
    ids = default_tokenizer("Tell me.").input_ids
    continuation = default_tokenizer(" Sure, here it is").input_ids
    target = ForcedTarget(tiny_wide, ids + continuation)
    out = autoregressive_decoder(target, default_tokenizer).generate(ids, SamplingParams(max_new_tokens=len(continuation)))
    assert out.token_ids == continuation and out.text == " Sure, here it is"


@pytest.mark.parametrize(
    "text, stop",
    [
        pytest.param(" I am happy 😀 and more words follow here", "😀", id="emoji-2-tokens"),
        # emoji in 3 byte tokens after a newline; 2 characters in 4 byte tokens
        pytest.param("\n😀 world and more words follow here", "😀", id="emoji-3-tokens"),
        pytest.param(" Say 你好 to them and more words follow", "你好", id="cjk-4-tokens"),
    ],
)
@pytest.mark.parametrize("k", [0, 3])
def test_stop_string_of_multibyte_characters(tiny_wide, default_tokenizer, text, stop, k):
    """The request stops at the token that completes the stop string, whatever the number of byte
    tokens its characters take. BUG (src/onlinespec/decoding/stopping.py, _stop_string_at_end):
    only the last len(stop) + 1 tokens are decoded, so a stop string whose characters need more
    tokens than that is never seen: the request runs on to max_new_tokens ("length")."""
    prompt = default_tokenizer("Tell me.").input_ids
    continuation = default_tokenizer(text).input_ids
    target = ForcedTarget(tiny_wide, prompt + continuation)
    proposer = DraftModelProposer(target) if k else None
    decoder = SpeculativeDecoder(target, default_tokenizer, proposer, k=k)
    out = decoder.generate(prompt, SamplingParams(max_new_tokens=len(continuation), stop_strings=(stop,)))
    before = text[: text.index(stop)]
    assert out.text == before
    # the stop string is complete after exactly these tokens
    n_stop = next(n for n in range(1, len(continuation) + 1) if stop in default_tokenizer.decode(continuation[:n]))
    assert out.token_ids == continuation[:n_stop]
    assert out.stats.finish_reason == "stop"


@pytest.mark.parametrize("k", [0, 3])
def test_stream_of_characters_split_across_tokens_joins_to_the_one_shot_decode(tiny_wide, default_tokenizer, k):
    """Emoji, CJK and accented characters whose bytes fall in several tokens (and rounds): the
    chunks join to the one-shot decode of the output, and no chunk ends inside a character."""
    prompt = default_tokenizer("Tell me.").input_ids
    text = " Café 你好 😀👍🏽 naïve 東京 ü😀é done"
    continuation = default_tokenizer(text).input_ids
    target = ForcedTarget(tiny_wide, prompt + continuation)
    decoder = SpeculativeDecoder(target, default_tokenizer, DraftModelProposer(target) if k else None, k=k)
    params = SamplingParams(max_new_tokens=len(continuation))
    chunks = list(decoder.stream(prompt, params))
    assert [t for c in chunks for t in c.token_ids] == continuation
    assert "".join(c.text for c in chunks) == text == decoder.generate(prompt, params).text
    assert not any(c.text.endswith("\ufffd") for c in chunks)


def test_stop_checker_sees_a_stop_string_spread_over_many_tokens(default_tokenizer):
    """Unit level of the bug above: feeding tokens one at a time, StopChecker must finish with
    "stop" on the token that completes the emoji."""
    from onlinespec.decoding.stopping import StopChecker

    ids = default_tokenizer("Hello\n😀 world").input_ids  # 'Hello', '\n', 3 byte tokens, ' world'
    checker = StopChecker(SamplingParams(max_new_tokens=50, stop_strings=("😀",)), frozenset(), default_tokenizer)
    kept = []
    for token in ids:
        kept += checker.clip([token])
        if checker.finish_reason:
            break
    assert checker.finish_reason == "stop"
    assert kept == ids[:5] and checker.text() == "Hello\n"


# ---- random state ------------------------------------------------------------------------------------------


def test_unseeded_sampling_leaves_the_global_rng_alone(tiny_target):
    """A request without a seed must not re-seed the caller's global torch RNG."""
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    SpeculativeDecoder(tiny_target).generate([1, 2], SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True))
    assert torch.equal(torch.rand(3), expected)


def test_seeded_sampling_leaves_the_global_rng_alone(tiny_target, tiny_draft):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    decoder = SpeculativeDecoder(tiny_target, None, DraftModelProposer(tiny_draft), k=2)
    decoder.generate([1, 2], SamplingParams(max_new_tokens=6, temperature=1.0, seed=9, ignore_eos=True))
    assert torch.equal(torch.rand(3), expected)


# ---- n-gram lookup ---------------------------------------------------------------------------------------


def test_ngram_lookup_copies_after_the_latest_longest_match():
    import numpy as np

    from onlinespec.decoding.proposers.ngram import lookup

    ids = np.array([7, 1, 2, 9, 9, 1, 2, 5, 6, 0, 1, 2])
    # suffix (1, 2) last occurred at 5..6, followed by 5, 6, 0
    assert lookup(ids, 3, max_ngram=2, min_ngram=1) == [5, 6, 0]
    # longer suffix (0, 1, 2) has no earlier match: falls back to (1, 2)
    assert lookup(ids, 2, max_ngram=3, min_ngram=1) == [5, 6]
    # the copy stops at the end of the text
    assert lookup(np.array([4, 8, 4]), 5, max_ngram=2, min_ngram=1) == [8, 4]
    assert lookup(np.array([3]), 4, max_ngram=3, min_ngram=1) == []
    assert lookup(np.array([1, 2, 3]), 4, max_ngram=3, min_ngram=1) == []


def test_a_longer_verbatim_match_makes_a_more_confident_copy():
    import numpy as np

    from onlinespec.decoding.proposers.ngram import copy_proposal

    chance = copy_proposal(np.array([7, 1, 2, 5, 9, 8, 1, 2]), 2, max_ngram=3, min_ngram=2)
    quoted = copy_proposal(np.array([3, 4, 5, 6, 1, 2, 5, 9, 3, 4, 5, 6, 1, 2]), 2, max_ngram=3, min_ngram=2)
    assert chance.tokens == quoted.tokens == [5, 9] and chance.drafter == quoted.drafter == "ngram"
    assert chance.confidences == [0.5, 0.5]  # two tokens matched
    assert quoted.confidences[0] == pytest.approx(6 / 8)  # six: the quoted line goes on
    assert copy_proposal(np.array([1, 2, 3]), 2, max_ngram=3, min_ngram=2) is None


def test_a_prompt_and_budget_past_the_context_is_a_clear_error(tiny_target):
    decoder = SpeculativeDecoder(tiny_target)  # the target alone (k = 0), a 256-token context
    with pytest.raises(ValueError, match=r"prompt \(200 tokens\) \+ max_new_tokens \(60\) exceeds the model's context of 256 "
                                         r"tokens: ask for at most 55 new tokens"):
        decoder.generate([1] * 200, SamplingParams(max_new_tokens=60))
    with pytest.raises(ValueError, match="shorten the prompt to at most 254 tokens"):
        decoder.generate([1] * 300, SamplingParams(max_new_tokens=1))
    assert len(decoder.generate([1] * 200, SamplingParams(max_new_tokens=55)).token_ids) <= 55


def test_non_finite_target_logits_are_an_error_never_a_token(tiny_target):
    decoder = SpeculativeDecoder(tiny_target, k=2)
    with torch.no_grad():
        saved = tiny_target.lm_head.weight.clone()
        tiny_target.lm_head.weight[3, 0] = float("nan")
    try:
        for params in (SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)):
            with pytest.raises(RequestFailed, match="FloatingPointError: the target's logits hold NaN or \\+inf"):
                decoder.generate([1, 2, 3], params)
    finally:
        with torch.no_grad():
            tiny_target.lm_head.weight.copy_(saved)
