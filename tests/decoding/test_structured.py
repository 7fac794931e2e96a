"""Constrained decoding with speculation on stays lossless (docs/engine.md, arXiv 2310.07177 background).

- greedy: the real default target with a learned-head + n-gram draft (``hybrid``), k = 2 and 4,
  in a batch mixing constrained and free rows, is token-identical to the target alone under the
  same JSON schema, and every output that ends by itself parses and validates with ``jsonschema``;
- sampling: a seeded chi-square test (N = 400, p-value > 1e-3) of the outputs of a ``regex``,
  a ``choice`` and a ``json_schema`` (an enum) constraint, with a tiny random target and a tiny random draft of the default tokenizer (k = 2),
  against the exact distribution of the target renormalised over the allowed tokens, enumerated
  one token at a time with the grammar's masks.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from onlinespec.decoding.grammar import Constraint, GrammarError, GrammarState, compile_constraint
from onlinespec.decoding.proposal import Proposal
from onlinespec.decoding.proposers.draft_model import DraftModelProposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from tests.conftest import build_tiny_llama

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
                                           "city": {"type": "string", "maxLength": 30}},
          "required": ["name", "age", "city"], "additionalProperties": False}
TODO = {"type": "object", "properties": {"task": {"type": "string", "maxLength": 40}, "done": {"type": "boolean"},
                                         "priority": {"enum": ["low", "medium", "high"]}},
        "required": ["task", "done", "priority"]}
PROMPTS = [[{"role": "user", "content": "Describe a person as JSON with a name, an age and a city."}],
           [{"role": "user", "content": "Write a to-do item as JSON."}]]
REGEX = "[ab]{3}"
N_RUNS = 400
PASS_P = 1e-3


@pytest.mark.slow
def test_greedy_under_a_schema_is_the_target_alone_at_several_k_in_a_mixed_batch(default_target):
    from onlinespec.decoding.autoregressive import autoregressive_decoder
    from onlinespec.factory import make_proposer

    t = default_target
    params = [SamplingParams(max_new_tokens=48, constraint=Constraint.json_schema(s)) for s in (PERSON, TODO)]
    free = SamplingParams(max_new_tokens=16)
    alone = autoregressive_decoder(t.model, t.tokenizer)
    reference = [alone.generate(m, p) for m, p in zip(PROMPTS, params)] + [alone.generate(PROMPTS[0], free)]
    for g, schema in zip(reference, (PERSON, TODO)):
        if g.stats.finish_reason == "eos":
            jsonschema.validate(json.loads(g.text), schema)
    assert any(g.stats.finish_reason == "eos" for g in reference[:2])
    for k in (2, 4):
        spec = SpeculativeDecoder(t.model, t.tokenizer, make_proposer("hybrid", t).proposer, k=k)
        out = spec.generate_many(PROMPTS + PROMPTS[:1], params + [free])
        assert [g.token_ids for g in out] == [g.token_ids for g in reference], k
        assert sum(g.stats.by_drafter.get("grammar", [0])[0] for g in out) > 0  # forced tokens were proposed


def test_a_bad_constraint_says_what_is_wrong(default_tokenizer):
    with pytest.raises(GrammarError, match="not valid JSON"):
        Constraint.json_schema("{not json")
    with pytest.raises(GrammarError, match="regex"):
        compile_constraint(Constraint("regex", "(unclosed"), default_tokenizer)
    with pytest.raises(GrammarError, match="non-empty strings"):
        Constraint.choice([])
    with pytest.raises(GrammarError, match="characters long"):  # a hostile size is refused before compiling
        Constraint("grammar", "x" * 300_000)


def test_proposals_forced_or_cut_by_the_grammar(default_tokenizer):
    state = GrammarState(Constraint.choice(["yes please", "no thanks"]), default_tokenizer, {default_tokenizer.eos_token_id})
    yes = default_tokenizer.encode("yes please", add_special_tokens=False)
    bad = default_tokenizer.encode("maybe", add_special_tokens=False)
    cut = state.propose(Proposal(yes[:1] + bad), keep_forbidden=False)
    assert cut.tokens == yes[:1]
    probs = torch.full((1 + len(bad), 8), 0.125)
    kept = state.propose(Proposal(yes[:1] + bad, probs), keep_forbidden=True)  # a sampled draft's forbidden token stays, rejected for sure
    assert kept.tokens == yes[:1] + bad[:1] and kept.probs.shape[0] == 2
    state.matcher.consume_token(yes[0])
    ahead = state.forced_tokens(4)  # asked before drafting: a forced round calls no draft
    assert ahead and default_tokenizer.decode(yes[:1] + ahead).startswith("yes")
    forced = state.propose(Proposal(), ahead)
    assert forced.drafter == "grammar" and forced.tokens == ahead and forced.confidences == [1.0] * len(ahead)
    continued = state.propose(Proposal(bad + yes[1:]), ahead)  # a lookup's continuation after them, cut where the grammar forbids
    assert continued.tokens == ahead


def test_a_sampled_drafts_eos_accepted_where_the_grammar_is_complete_ends_the_request(default_tokenizer):
    """Where the grammar is complete, llguidance's validate_tokens refuses EOS while the mask allows
    it: a sampled draft's EOS was kept as its (forbidden) last proposal, the verifier accepted it,
    and consuming the round's own token after it raised (compose-spec, bench/structured.py)."""
    eos = default_tokenizer.eos_token_id
    state = GrammarState(Constraint.choice(["yes"]), default_tokenizer, {eos})
    for token in default_tokenizer.encode("yes", add_special_tokens=False):
        assert state.matcher.consume_token(token)
    kept = state.propose(Proposal([eos], torch.full((1, 8), 0.125)), keep_forbidden=True)
    masked, taken = state.mask(torch.zeros(2, len(default_tokenizer)), kept.tokens)
    assert kept.tokens == [eos] and taken == 0 and masked[0, eos] == 0  # refused by validation, allowed by the mask
    newline = default_tokenizer.encode("\n", add_special_tokens=False)[0]
    state.advance(taken, 1, newline)  # EOS accepted: the request ends there, the token after it is never emitted


@pytest.fixture(scope="module")
def tiny_pair(default_tokenizer):
    vocab = len(default_tokenizer)
    target = build_tiny_llama(11, vocab_size=vocab, hidden_size=16, num_layers=2, head_scale=3.0)
    draft = build_tiny_llama(12, vocab_size=vocab, hidden_size=16, num_layers=1, head_scale=3.0)
    return target, draft


def exact_distribution(target, tokenizer, prompt: list[int], constraint: Constraint, eos: int) -> dict[str, float]:
    """Every output the constraint allows, with the target's probability renormalised over the allowed tokens at each step."""
    out: dict[str, float] = {}

    def walk(state: GrammarState, ids: list[int], text: list[int], prob: float) -> None:
        logits = target(torch.tensor([ids])).logits[0, -1:].float()
        masked, _ = state.mask(logits, [])
        probs = masked.softmax(-1)[0]
        for token in probs.nonzero().flatten().tolist():
            p = prob * float(probs[token])
            if token == eos:
                key = tokenizer.decode(text)
                out[key] = out.get(key, 0.0) + p
                continue
            child = GrammarState(constraint, tokenizer, {eos})
            child.matcher.consume_tokens(text + [token])
            walk(child, ids + [token], text + [token], p)

    walk(GrammarState(constraint, tokenizer, {eos}), prompt, [], 1.0)
    return out


# each constraint's outputs: few, so the exact law can be enumerated (every tokenisation of each text summed)
SAMPLED = {"regex": (Constraint("regex", REGEX), 8), "choice": (Constraint.choice(["yes", "no", "maybe"]), 3),
           "json_schema": (Constraint.json_schema({"enum": ["red", "green", "blue"]}), 3)}


@pytest.mark.parametrize("kind", list(SAMPLED))
@torch.inference_mode()
def test_sampled_output_follows_the_renormalised_target_with_speculation(kind, tiny_pair, default_tokenizer, chi_square, one_thread):
    target, draft = tiny_pair
    eos = default_tokenizer.eos_token_id
    constraint, outcomes = SAMPLED[kind]
    prompt = [1, 400, 2000, 31]
    expected = exact_distribution(target, default_tokenizer, prompt, constraint, eos)
    assert abs(sum(expected.values()) - 1) < 1e-4 and len(expected) == outcomes
    decoder = SpeculativeDecoder(target, default_tokenizer, DraftModelProposer(draft), k=2, eos_token_ids=frozenset({eos}))
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=30_000 + i, constraint=constraint) for i in range(N_RUNS)]
    out = decoder.generate_many([prompt] * N_RUNS, params, max_batch=32)
    keys = sorted(expected)
    counts = [sum(g.text == key for g in out) for key in keys]
    assert sum(counts) == N_RUNS  # every output matched the regex and ended
    p, stat, df = chi_square(counts, [expected[key] for key in keys])
    assert p > PASS_P, (counts, [round(expected[key] * N_RUNS) for key in keys], stat, df)
