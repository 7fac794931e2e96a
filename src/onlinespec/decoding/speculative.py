"""The propose / verify loop with KV caches: lossless speculative decoding, batch size 1.

One round: the proposer drafts up to ``k`` tokens; the target runs ONE forward pass over the
tokens its cache has not seen plus the proposals (the first round: the whole prompt, so prefill
and the first verification share a pass); :mod:`onlinespec.decoding.verify` accepts a prefix and
adds one token; the target cache is cut back to the accepted tokens. With no proposer (or
``k = 0``) the same loop is plain autoregressive decoding of the target alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from onlinespec.decoding.adaptive import AdaptiveK, trim
from onlinespec.decoding.kvcache import truncate_cache
from onlinespec.decoding.proposers.base import Proposal, Proposer
from onlinespec.decoding.sampling import SamplingParams, logits_to_probs
from onlinespec.decoding.stopping import StopChecker
from onlinespec.decoding.verify import Verdict, verify_greedy, verify_sampling

Prompt = str | list[dict] | list[int]


@dataclass
class RoundTrace:
    """What one verification saw; the online learner trains on these without re-running the target.

    ``position`` is the index, in the request's full token sequence (prompt + generated), of the
    first proposal; proposal ``i`` sits at ``position + i`` and was scored by the target's
    distribution at row ``i`` (the logits computed at position ``position + i - 1``). Row
    ``len(proposals)`` is the distribution after the last proposal (the bonus position).
    """

    position: int
    proposals: list[int]
    draft_probs: list[float] | None  # q(x_i) of each proposal; None for a point-mass proposer
    target_top_ids: torch.Tensor  # [len(proposals) + 1, K] int64
    target_top_logprobs: torch.Tensor  # [len(proposals) + 1, K] float32, log-softmax at temperature 1
    n_accepted: int
    next_token: int  # the target's correction (n_accepted < len(proposals)) or bonus token
    # [len(proposals) + 1, H] float16: the target's post-norm hidden state at every row (positions
    # position - 1 .. position + len(proposals) - 1), when the proposer reads features. Rows past
    # n_accepted are conditioned on rejected proposals: the student-sampled rows of online learning
    target_features: torch.Tensor | None = None

    @property
    def accepted(self) -> list[bool]:
        return [i < self.n_accepted for i in range(len(self.proposals))]


@dataclass(frozen=True)
class RoundTiming:
    proposed: int
    draft_seconds: float  # draft forwards of this round
    target_seconds: float  # the target's forward (round 0: prefill + first verification)


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # = target calls: one target forward per round
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended on a rejection (at most one rejection per round)
    seconds: float = 0.0
    target_seconds: float = 0.0  # target forwards
    draft_seconds: float = 0.0  # draft forwards
    finish_reason: str | None = None
    timings: list[RoundTiming] = field(default_factory=list, repr=False)
    # per draft step j (index j - 1): proposals judged there (every earlier one was accepted), and
    # how many of them the target accepted: step_accepted[j] / step_judged[j] is step j's acceptance
    step_judged: list[int] = field(default_factory=list)
    step_accepted: list[int] = field(default_factory=list)

    @property
    def target_calls(self) -> int:
        return self.rounds

    @property
    def acceptance_rate(self) -> float:
        """alpha: the share of target-judged proposals it accepted (the paper's per-token alpha).

        Proposals after the first rejection of a round are never judged; counting them would
        mix proposal length into alpha. Under the paper's i.i.d. model this is alpha's estimate.
        """
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per target call (accepted proposals + the target's own token)."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def overhead_seconds(self) -> float:
        """Everything the engine spends outside model forwards (verification, caches, stopping)."""
        return self.seconds - self.target_seconds - self.draft_seconds

    def to_dict(self) -> dict:
        names = ["acceptance_rate", "mean_accepted_length", "tokens_per_s", "target_calls", "overhead_seconds"]
        fields = {key: value for key, value in self.__dict__.items() if key != "timings"}
        return {**fields, **{n: getattr(self, n) for n in names}}


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # generated ids (EOS included when it ended the request)
    prompt_ids: list[int]
    stats: RequestStats
    trace: list[RoundTrace] = field(default_factory=list)


@dataclass
class StreamChunk:
    token_ids: list[int]  # the tokens this round added
    text: str  # the text they complete (held back while a stop string may be forming)
    stats: RequestStats | None = None  # set on the last chunk of the request


class SpeculativeDecoder:
    """Lossless speculative decoding of ``target`` with drafts from ``proposer``.

    >>> decoder = SpeculativeDecoder(target, tokenizer, DraftModelProposer(draft), k=4)
    >>> out = decoder.generate("Write a haiku", SamplingParams(max_new_tokens=64))
    >>> out.text, out.stats.acceptance_rate
    """

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer=None,
        proposer: Proposer | None = None,
        k: int = 4,
        trace_top_k: int = 32,
        verify_padding: dict[int, int] | None = None,
        adaptive_k: AdaptiveK | None = None,
    ) -> None:
        """``verify_padding`` maps a verification block's width to a larger width that the
        target runs faster (see :mod:`onlinespec.decoding.calibrate`); default: no padding.
        ``adaptive_k``: send, per round, only as many of the (up to ``k``) proposals as the cost
        model says pay (:mod:`onlinespec.decoding.adaptive`); default: all of them."""
        if k < 0:
            raise ValueError(f"k (proposal length) must be >= 0, got {k}")
        self.target, self.tokenizer, self.proposer = target, tokenizer, proposer
        self.k = k if proposer is not None else 0
        self.trace_top_k = trace_top_k
        self.verify_padding = verify_padding or {}
        self.adaptive_k = adaptive_k
        eos = target.generation_config.eos_token_id if target.generation_config else None
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))

    # ---- public API -------------------------------------------------------------------------

    def generate(self, prompt: Prompt, params: SamplingParams = SamplingParams(), trace: bool = False) -> Generation:
        """Decode one request to the end. ``prompt``: text, chat messages, or token ids."""
        prompt_ids = self.encode(prompt)
        stats, stop, traces = RequestStats(), self._stop_checker(params), []
        for _ in self._rounds(prompt_ids, params, stats, stop, traces if trace else None):
            pass
        text = stop.text() if self.tokenizer is not None else ""
        return Generation(text, list(stop.generated), prompt_ids, stats, traces)

    def stream(self, prompt: Prompt, params: SamplingParams = SamplingParams()) -> Iterator[StreamChunk]:
        """Yield each round's tokens and the text they complete, as soon as the round is verified."""
        if self.tokenizer is None:
            raise ValueError("streaming text needs a tokenizer")
        prompt_ids = self.encode(prompt)
        stats, stop = RequestStats(), self._stop_checker(params)
        emitted = ""
        for tokens in self._rounds(prompt_ids, params, stats, stop, None):
            text = stop.text()
            if stop.finish_reason is None:
                text = _hold_back(text, params.stop_strings)
            yield StreamChunk(tokens, text[len(emitted):], stats if stop.finish_reason else None)
            emitted = max(emitted, text, key=len)

    def encode(self, prompt: Prompt) -> list[int]:
        needs_tokenizer = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))
        return encode_prompt(self._require_tokenizer() if needs_tokenizer else None, prompt)

    # ---- the loop ---------------------------------------------------------------------------

    @torch.inference_mode()
    def _rounds(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        stats: RequestStats,
        stop: StopChecker,
        traces: list[RoundTrace] | None,
    ) -> Iterator[list[int]]:
        start = time.perf_counter()
        generator = None
        if not params.greedy:  # a private generator: never touch torch's global random state
            generator = torch.Generator()
            generator.manual_seed(params.seed) if params.seed is not None else generator.seed()
        ids = list(prompt_ids)
        cache = DynamicCache(config=self.target.config)
        cached = 0  # ids whose keys/values are in the target cache
        stats.prompt_tokens = len(ids)
        if self.proposer is not None:
            self.proposer.begin(ids)
        want_probs = traces is not None
        features = getattr(self.proposer, "uses_features", False)
        while stop.finish_reason is None:
            # A round emits accepted + 1 tokens: never propose past max_new_tokens.
            k = min(self.k, stop.remaining - 1)
            proposal = Proposal()
            if k > 0:
                proposal = self.proposer.propose(ids, k, params, generator, with_probs=want_probs)
                if self.adaptive_k is not None and len(proposal):
                    proposal = trim(proposal, self.adaptive_k.choose(proposal, len(ids) - cached, params.greedy))
            n = len(proposal)
            block = ids[cached:] + proposal.tokens
            pad = self.verify_padding.get(len(block), len(block)) - len(block)
            tick = time.perf_counter()
            logits, hidden = self._forward(block + block[-1:] * pad, cache, n + 1 + pad, features)
            logits = logits[: n + 1]
            if not logits.is_contiguous():  # the small-batch kernels return [V, n] transposed: every
                logits = torch.stack(tuple(logits))  # row-wise op after this runs 3-5x faster on rows
            target_seconds = time.perf_counter() - tick
            stats.timings.append(RoundTiming(len(proposal), proposal.forward_seconds, target_seconds))
            stats.target_seconds += target_seconds
            stats.draft_seconds += proposal.forward_seconds
            verdict = self._verify(proposal, logits, params, generator)
            if traces is not None:
                traces.append(self._trace(len(ids), proposal, logits, verdict, hidden))
            if self.adaptive_k is not None and n:
                self.adaptive_k.update(proposal, verdict.n_accepted, params.greedy)
            if features:  # the state at the last accepted position: what the next draft step reads
                self.proposer.observe(hidden[verdict.n_accepted])
            cached = len(ids) + verdict.n_accepted
            truncate_cache(cache, cached)
            new = stop.clip(proposal.tokens[: verdict.n_accepted] + [verdict.next_token])
            ids.extend(new)
            stats.rounds += 1
            stats.proposed += n
            stats.accepted += verdict.n_accepted
            stats.rejected += verdict.n_accepted < n
            for i in range(min(n, verdict.n_accepted + 1)):
                if i == len(stats.step_judged):
                    stats.step_judged.append(0)
                    stats.step_accepted.append(0)
                stats.step_judged[i] += 1
                stats.step_accepted[i] += i < verdict.n_accepted
            stats.new_tokens = len(stop.generated)
            stats.seconds = time.perf_counter() - start
            stats.finish_reason = stop.finish_reason
            yield new

    def _forward(self, block: list[int], cache: DynamicCache, keep: int, features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's logits for the last ``keep`` tokens of ``block`` (and, when the proposer
        reads them, the post-norm hidden states they came from: no extra cost)."""
        input_ids = torch.tensor([block])
        if not features:
            return self.target(input_ids=input_ids, cache=cache, logits_to_keep=keep).logits[0], None
        hidden = self.target.get_decoder()(input_ids=input_ids, cache=cache).last_hidden_state[0, -keep:]
        return self.target.get_output_embeddings()(hidden), hidden

    @staticmethod
    def _verify(proposal: Proposal, logits: torch.Tensor, params: SamplingParams, generator) -> Verdict:
        if params.greedy:
            return verify_greedy(proposal.tokens, logits)
        return verify_sampling(proposal.tokens, proposal.probs, logits_to_probs(logits, params), generator)

    def _trace(self, position: int, proposal: Proposal, logits: torch.Tensor, verdict: Verdict, hidden: torch.Tensor | None) -> RoundTrace:
        top = torch.log_softmax(logits.float(), -1).topk(min(self.trace_top_k, logits.shape[-1]), dim=-1)
        draft_probs = proposal.confidences or None  # a greedy head: q(x_i) of its own choice, at temperature 1
        if proposal.probs is not None:
            draft_probs = proposal.probs[torch.arange(len(proposal)), torch.tensor(proposal.tokens, dtype=torch.long)].tolist()
        kept = hidden[: len(proposal) + 1].to(torch.float16) if hidden is not None else None
        return RoundTrace(
            position, list(proposal.tokens), draft_probs, top.indices, top.values, verdict.n_accepted, verdict.next_token, kept
        )

    def _stop_checker(self, params: SamplingParams) -> StopChecker:
        return StopChecker(params, self.eos_token_ids, self.tokenizer)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this decoder has no tokenizer: pass token ids, or build it with one")
        return self.tokenizer


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt``: ids as they are, text as it is, chat messages through the template."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = list(prompt)
    elif isinstance(prompt, list):
        if not any(str(m.get("content") or "").strip() for m in prompt):
            raise ValueError("the prompt is empty: the chat messages have no content")
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"]
    elif isinstance(prompt, str):
        ids = tokenizer(prompt).input_ids
    else:
        raise TypeError(f"prompt must be text, chat messages or token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty: give at least one character of text or one chat message")
    return ids


def _hold_back(text: str, stop_strings: tuple[str, ...]) -> str:
    """Drop a trailing partial character, and any tail that might be the start of a stop string."""
    text = text.rstrip("\ufffd")
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                text = text[:-n]
                break
    return text
