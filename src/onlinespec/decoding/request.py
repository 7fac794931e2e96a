"""One request as the engine carries it between steps, and what it reports.

:class:`RequestState` is everything that belongs to one request and nothing that belongs to the
batch: its tokens, stop checker, random generator, the proposer it drafts with and that
proposer's state for it, its statistics and its verification trace. The engine
(:mod:`onlinespec.decoding.engine`) advances many of them per step.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from onlinespec.decoding.acceptance import AdaptiveK
from onlinespec.decoding.grammar import GrammarState
from onlinespec.decoding.logprobs import TokenLogprob
from onlinespec.decoding.proposers.base import Proposer
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.stopping import StopChecker


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
    draft_seconds: float  # the draft call of the step this round was in
    target_seconds: float  # the target forward this round was in (round 0: prefill + first verification)
    batch: int = 1  # requests verified in that forward
    drafter: str = ""  # who proposed this round's tokens (Proposal.drafter: ngram, suffix, head, ...)


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # = target calls: one target forward per round
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds that ended on a rejection (at most one rejection per round)
    seconds: float = 0.0  # from submission to the last token (time waiting for a slot included)
    first_token_seconds: float = 0.0  # from submission to the first token
    queued_seconds: float = 0.0  # from submission to joining the batch (waiting for a slot)
    target_seconds: float = 0.0  # target forwards this request was in
    draft_seconds: float = 0.0  # draft calls this request was in
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens whose cells came from the prefix cache (usage.prompt_tokens_details.cached_tokens)
    prefix_queried: int = 0  # prompt tokens looked up in the prefix cache (0: no lookup, the cache is off)
    timings: list[RoundTiming] = field(default_factory=list, repr=False)
    # per draft step j (index j - 1): proposals judged there (every earlier one was accepted), and
    # how many of them the target accepted: step_accepted[j] / step_judged[j] is step j's acceptance
    step_judged: list[int] = field(default_factory=list)
    step_accepted: list[int] = field(default_factory=list)
    # rounds that sent proposals, by how many the target accepted: accepted_histogram[n] rounds kept n
    accepted_histogram: list[int] = field(default_factory=list)
    # per drafter (Proposal.drafter: ngram, suffix, head, ...): [proposals sent, accepted]
    by_drafter: dict[str, list[int]] = field(default_factory=dict)

    def add_round(self, proposed: int, accepted: int, timing: RoundTiming, drafter: str = "draft") -> None:
        """Count one verified round: ``proposed`` proposals sent (by ``drafter``), the first ``accepted`` kept."""
        self.rounds += 1
        if proposed:
            tally = self.by_drafter.setdefault(drafter, [0, 0])
            tally[0] += proposed
            tally[1] += accepted
        self.proposed += proposed
        self.accepted += accepted
        self.rejected += accepted < proposed
        if proposed:
            self.accepted_histogram.extend([0] * (accepted + 1 - len(self.accepted_histogram)))
            self.accepted_histogram[accepted] += 1
        for i in range(min(proposed, accepted + 1)):
            if i == len(self.step_judged):
                self.step_judged.append(0)
                self.step_accepted.append(0)
            self.step_judged[i] += 1
            self.step_accepted[i] += i < accepted
        self.timings.append(timing)
        self.target_seconds += timing.target_seconds
        self.draft_seconds += timing.draft_seconds

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
    def latency_seconds(self) -> float:
        """From joining the batch to the last token (what a client sending it then would wait)."""
        return self.seconds - self.queued_seconds

    @property
    def ttft_seconds(self) -> float:
        """Time to first token, from joining the batch."""
        return self.first_token_seconds - self.queued_seconds

    @property
    def overhead_seconds(self) -> float:
        """Everything outside model forwards (verification, caches, stopping, waiting)."""
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
    logprobs: list[TokenLogprob] | None = None  # per generated token, when SamplingParams.logprobs asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, when SamplingParams.prompt_logprobs asked


@dataclass
class StreamChunk:
    token_ids: list[int]  # the tokens this round added
    text: str  # the text they complete (held back while a stop string may be forming)
    stats: RequestStats | None = None  # set on the last chunk of the request


_ids = itertools.count()


@dataclass(eq=False)
class RequestState:
    """One request between steps. Compared by identity: the engine keys its cache rows on it."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: StopChecker
    proposer: Proposer | None = None
    adaptive: AdaptiveK | None = None  # its draft's acceptance statistics (adaptive k); None: fixed k
    # a seeded sampled request's own statistics, from its own rounds alone (StepPlanner.own_ask): its
    # k, and so its text, depend on its seed and not on what else was served
    own_adaptive: AdaptiveK | None = None
    trace: list[RoundTrace] | None = None  # None: not traced
    id: int = field(default_factory=lambda: next(_ids))
    ids: list[int] = field(default_factory=list)  # prompt + generated
    stats: RequestStats = field(default_factory=RequestStats)
    generator: torch.Generator | None = None
    draft_state: Any = None  # the proposer's state for this request (Proposer.start)
    prefilled: int = 0  # tokens of ``ids`` already in the target cache while it (re)fills (chunked prefill)
    # the tokens its tenant may still prefill in this step, one list shared by the tenant's running
    # requests (the scheduler's fair share, each step); None: the step's whole prefill budget. Past
    # it, a row's block (k + 1 tokens) runs when ``prefill_credit`` (seconds: one batch row's time
    # per step waited) covers its cost at ``prefill_rate`` (seconds per token of its last chunk)
    prefill_share: list[int] | None = None
    prefill_credit: float = 0.0
    prefill_rate: float = 0.0
    submitted: float = field(default_factory=time.perf_counter)
    new_tokens: list[int] = field(default_factory=list)  # what the last step emitted
    embed: bool = False  # keep a prompt embedding from the prefill's hidden states (content routing)
    prompt_embedding: torch.Tensor | None = None  # [H], once the prompt is prefilled (see add_prompt_states)
    error: str | None = None  # what failed this request alone inside a step (it is finished; the others go on)
    tenant: str = ""  # whose earlier requests its suffix index drafts from ("": the shared ones)
    # prefix caching (onlinespec.decoding.prefix_cache): the key whose cached cells it may reuse and
    # leaves its own under, (tenant, cache_salt), None: neither; and the request id a purge names
    cache_key: tuple[str, str] | None = None
    cache_owner: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per new token, when params.logprobs is set
    # per prompt token when params.prompt_logprobs is set (None for the first, which nothing scores)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    grammar: GrammarState | None = None  # its matcher, when params.constraint asks for structured output

    def __post_init__(self) -> None:
        self.ids = list(self.prompt_ids)
        self.stats.prompt_tokens = len(self.prompt_ids)
        self.prompt_logprobs = [None] if self.params.prompt_logprobs is not None and self.prompt_ids else []
        if not self.params.greedy:  # a private generator: never touch torch's global random state
            self.generator = torch.Generator()
            self.generator.manual_seed(self.params.seed) if self.params.seed is not None else self.generator.seed()
        if self.params.constraint is not None and self.grammar is None:
            if self.stop.tokenizer is None:
                raise ValueError("a constrained request needs a tokenizer (its grammar reads the tokens' text)")
            self.grammar = GrammarState(self.params.constraint, self.stop.tokenizer, self.stop.eos_token_ids)
        if self.proposer is not None:
            self.draft_state = self.proposer.start(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.stop.finish_reason is not None or self.error is not None

    def recompute(self) -> None:
        """Forget the target cache: the next step prefills ``ids`` (prompt and generated) again,
        as vLLM recomputes a preempted request. Its text goes on as if nothing happened."""
        self.prefilled = 0
        if self.proposer is not None:
            self.draft_state = self.proposer.start(self.ids)

    def add_prompt_states(self, states: torch.Tensor) -> None:
        """The target's post-norm hidden states of the prompt's last prefill chunk ([n, H], computed
        anyway): the prompt's embedding is the unit state at its final position (for a chat prompt,
        the assistant header: the target's summary of the whole prompt before it answers;
        docs/routing.md compares it with the prompt's mean state)."""
        if self.embed and len(states):
            self.prompt_embedding = torch.nn.functional.normalize(states[-1].float(), dim=0)

    @property
    def fixed_k(self) -> bool:
        """A seeded sampled request drafts and verifies the same number of proposals whatever
        else is in the batch: its random draws, and so its text, depend on its seed alone. With
        adaptive k that number comes from its own rounds alone (:attr:`own_adaptive`)."""
        return self.params.reproducible
