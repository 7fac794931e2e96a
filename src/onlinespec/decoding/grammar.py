"""Constrained decoding: a grammar masks the target's distribution, and speculation stays lossless.

A request's :class:`Constraint` (a JSON schema, any JSON object, a regular expression, a choice
of strings, or a Lark / GBNF grammar) compiles once, with llguidance (docs/engine.md says why
that engine), into a matcher that each constrained request copies (:class:`GrammarState`).

How it meets speculation (arXiv 2310.07177, background; docs/engine.md):

- **before verification** (:meth:`GrammarState.forced_tokens`, :meth:`GrammarState.propose`): where
  the grammar forces the next tokens (one allowed continuation: ``{"name": "`` after ``{`` in a
  schema), those tokens are the round's first proposals, asked before drafting so that no draft
  is called (SGLang's jump-forward), and a greedy request's free lookups continue them from the
  text they complete; otherwise the draft's
  proposals are cut at the first one the grammar forbids. A sampled draft's forbidden token is
  kept (its probability under the masked target is 0, so it is rejected with certainty and the
  correction is drawn from ``norm(max(0, p - q))``, as the exact rejection sampler requires);
- **at verification** (:meth:`GrammarState.mask`): the matcher advances along the proposals and
  row ``i`` of the target's logits is masked to what the grammar allows after the first ``i``;
  the verifier then accepts against the masked target, greedy or sampled, exactly as without a
  grammar. :meth:`GrammarState.advance` rolls the matcher back to the accepted prefix and takes
  the round's correction or bonus token.

So greedy output is the target's own under the same constraint, token for token, and sampled
output follows the target's distribution renormalised over the allowed tokens.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
import llguidance.numpy  # not llguidance.torch: its torch.compile'd kernel imports torch's compiler, 2 s at every process start
import torch

from onlinespec.decoding.proposal import DraftInput, Proposal, trim

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 200_000  # a schema, regex or grammar longer than this is refused before compiling
MAX_CHOICES = 1000  # strings in a choice constraint
MAX_CACHED = 64  # compiled grammars kept (least recently used dropped first)
# llguidance's own bounds on work: building the lexer and each mask step (a hostile grammar fails
# with an error instead of holding the engine thread)
LIMITS = {"max_grammar_size": 200_000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
          "max_lexer_states": 100_000, "max_items_in_row": 2000}
# compact JSON (no free whitespace: a small model may otherwise loop on spaces); keywords llguidance
# does not enforce are ignored (listed in docs/engine.md) instead of refusing the schema
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": True, "coerce_one_of": True}


class GrammarError(ValueError):
    """A constraint that does not compile: the message says what is wrong (a 400 at the server)."""


@dataclass(frozen=True)
class Constraint:
    """What the output must match. ``kind``: one of :data:`KINDS`; ``spec``: the schema (JSON
    text), the regex, the choices (a JSON list of strings) or the grammar's text."""

    kind: str
    spec: str = ""
    source: str = field(default="", compare=False)  # the request field that asked for it (for errors; not part of its identity)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"constraint kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise GrammarError(f"the {self.kind} is {len(self.spec)} characters long: at most {MAX_SPEC_CHARS}")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as err:
                raise GrammarError(f"the JSON schema is not valid JSON: {err}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object (or a boolean), got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # key order kept: the output follows the properties in order

    @classmethod
    def choice(cls, choices: list[str]) -> Constraint:
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError(f"a choice is a list of 1 to {MAX_CHOICES} non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    def grammar(self) -> str:
        """The llguidance grammar this constraint stands for."""
        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                return llguidance.grammar_from("choice", self.spec)
            return llguidance.grammar_from("grammar", self.spec)  # Lark, or llama.cpp's GBNF (converted)
        except (ValueError, TypeError) as err:
            raise GrammarError(f"the {self.kind} does not compile: {err}") from None


_lock = threading.Lock()
_tokenizers: dict[tuple[int, tuple[int, ...]], tuple[object, llguidance.LLTokenizer]] = {}
_compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()


def ll_tokenizer(tokenizer, eos_token_ids) -> llguidance.LLTokenizer:
    """llguidance's view of a transformers tokenizer (about a second to build: built once)."""
    eos = tuple(sorted(eos_token_ids)) or (tokenizer.eos_token_id,)
    key = (id(tokenizer), eos)
    with _lock:
        held = _tokenizers.get(key)
        if held is None or held[0] is not tokenizer:
            held = _tokenizers[key] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=list(eos)))
        return held[1]


def compile_constraint(constraint: Constraint, tokenizer, eos_token_ids=()) -> llguidance.LLMatcher:
    """A fresh matcher for ``constraint`` (a copy of the cached compiled one); :class:`GrammarError`
    naming what is wrong when it does not compile or passes :data:`LIMITS`."""
    lltok = ll_tokenizer(tokenizer, eos_token_ids)
    key = (id(lltok), constraint)
    with _lock:
        matcher = _compiled.get(key)
        if matcher is not None:
            _compiled.move_to_end(key)
            return matcher.deep_copy()
    matcher = llguidance.LLMatcher(lltok, constraint.grammar(), log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
    if matcher.is_error():
        raise GrammarError(f"the {constraint.kind} does not compile: {matcher.get_error()}")
    with _lock:
        _compiled[key] = matcher
        while len(_compiled) > MAX_CACHED:
            _compiled.popitem(last=False)
    return matcher.deep_copy()


class GrammarState:
    """One request's matcher, kept at the end of its output between rounds."""

    def __init__(self, constraint: Constraint, tokenizer, eos_token_ids=()) -> None:
        self.constraint = constraint
        self.matcher = compile_constraint(constraint, tokenizer, eos_token_ids)
        self.vocab = ll_tokenizer(tokenizer, eos_token_ids).vocab_size
        self.forced = 0  # tokens proposed because the grammar forced them (jump-forward)
        self.cut = 0  # draft proposals cut because the grammar forbids them

    def forced_tokens(self, most: int) -> list[int]:
        """The next tokens the grammar forces (SGLang's jump-forward), at most ``most``: asked
        before drafting, so that a forced round calls no draft."""
        return self.matcher.compute_ff_tokens()[:most] if most > 0 else []

    def propose(self, proposal: Proposal, forced: list[int] = (), keep_forbidden: bool = False) -> Proposal:
        """The round's proposals: the ``forced`` tokens then ``proposal``'s (drafted after them: a
        lookup's continuation), or the draft's alone; either cut at the first token the grammar
        forbids (kept, last, when ``keep_forbidden``: a sampled draft's, see the module docstring)."""
        if forced:
            self.forced += len(forced)
            more = proposal.tokens[: self.matcher.validate_tokens(list(forced) + proposal.tokens) - len(forced)]
            confidences = [1.0] * len(forced) + list((proposal.confidences or [0.0] * len(more))[: len(more)])
            return Proposal(list(forced) + more, confidences=confidences, drafter="grammar")
        valid = self.matcher.validate_tokens(proposal.tokens)
        if valid == len(proposal):
            return proposal
        self.cut += len(proposal) - valid - keep_forbidden
        keep = valid + keep_forbidden
        return Proposal(proposal.tokens[:keep], proposal.probs[:keep] if proposal.probs is not None else None,
                        proposal.forward_seconds, proposal.confidences[:keep] if proposal.confidences is not None else None,
                        proposal.drafter)

    def mask(self, logits: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, int]:
        """``logits`` ``[n + 1, V]`` with row ``i`` masked to what the grammar allows after the
        first ``i`` of ``tokens``; the matcher is left after the tokens it took (returned: their
        count; a forbidden one stops it, and rows after it stay unmasked: never used)."""
        rows = len(tokens) + 1
        bits = torch.full((rows, (self.vocab + 31) // 32), -1, dtype=torch.int32)
        taken = self.matcher.validate_tokens(tokens)  # a forbidden token is never consumed (it would break the matcher)
        view = bits.numpy()  # the same memory: the matcher writes the tensor's rows
        for i in range(taken + 1):
            llguidance.numpy.fill_next_token_bitmask(self.matcher, view, i)
            if self.matcher.is_error():
                raise RuntimeError(f"the grammar failed: {self.matcher.get_error()}")
            if i < taken:
                self.matcher.consume_token(tokens[i])
        allowed = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(rows, -1)
        width = logits.shape[-1]
        allowed = allowed[:, :width] if allowed.shape[1] >= width else torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]))
        if not allowed[: taken + 1].any(-1).all():
            raise RuntimeError("the grammar allows no token here (a grammar that cannot end, or no EOS allowed)")
        return logits.float().masked_fill(~allowed, float("-inf")), taken

    def advance(self, taken: int, accepted: int, next_token: int) -> None:
        """After the verdict: back to the accepted prefix of the ``taken`` proposals, then the round's own token."""
        if accepted > taken:
            # the verifier accepted a proposal the matcher did not take: a sampled draft's EOS kept
            # as its last proposal where the grammar is complete (llguidance's validate_tokens
            # refuses EOS there, its mask allows it). The request ends at that EOS: the round's
            # own token after it is never emitted, and the matcher has nothing more to consume.
            return
        if taken > accepted:
            self.matcher.rollback(taken - accepted)
        if not self.matcher.consume_token(next_token):
            raise RuntimeError(f"the grammar refused token {next_token} it allowed: {self.matcher.get_error()}")


# ---- a step's constrained rows (the engine calls these; ``rows`` are its RequestStates) ----------


def forced_rows(rows: list, asks: list[int], k: int) -> dict[int, list[int]]:
    """The tokens each constrained row's grammar forces next (:meth:`GrammarState.forced_tokens`),
    by row index; those rows ask their draft for nothing (``asks`` zeroed in place)."""
    forced = {}
    for i, r in enumerate(rows):
        if r.grammar is not None and not r.finished and r.proposer is not None:  # the target alone proposes nothing
            tokens = r.grammar.forced_tokens(min(k, r.stop.remaining - 1))
            if tokens:
                forced[i], asks[i] = tokens, 0
    return forced


def constrain(rows: list, proposals: list[Proposal], forced: dict[int, list[int]], k: int) -> list[Proposal]:
    """Constrained rows propose what their grammar forces (continued by a greedy row's free
    lookups from the text the forced tokens complete), or their draft's proposals cut where the
    grammar forbids (:meth:`GrammarState.propose`)."""
    for i, r in enumerate(rows):
        if r.grammar is None or r.finished:
            continue
        tokens = forced.get(i, [])
        if tokens:
            proposals[i] = _continue_forced(r, tokens, k)
        proposals[i] = r.grammar.propose(proposals[i], tokens, not r.params.greedy and proposals[i].probs is not None)
    return proposals


def _continue_forced(r, forced: list[int], k: int) -> Proposal:
    """What a greedy request's free lookups draft after its ``forced`` tokens (nothing for a
    sampled one, or when its proposer has no lookups): the tokens the forced ones lead to."""
    room = min(k, r.stop.remaining - 1) - len(forced)
    if room <= 0 or not r.params.greedy or not r.proposer.free_drafts:
        return Proposal(drafter="grammar")
    ahead = DraftInput(r.ids + forced, room, r.params, r.generator, r.draft_state, tenant=r.tenant)
    try:
        return trim(r.proposer.propose_free([ahead])[0], room)
    except Exception:  # drafts are advice
        logging.getLogger("onlinespec.engine").exception("proposer %s failed a lookup; the forced tokens go alone", r.proposer.name)
        return Proposal(drafter="grammar")
