"""The batched propose / verify step: every running request advances one round per step.

One step, for the requests the scheduler made active (:meth:`SpeculativeEngine.step`), in phases:

1. **leave** (``_leave``): rows of requests that finished or were dropped leave the batch cache;
   each learned proposer takes a draft the online learner handed over (between steps only);
2. **admit** (``_admit``): a new request's prompt runs in forwards of its own, in chunks of at most
   ``prefill_chunk`` tokens per step while others are decoding (a long prompt never stalls them for
   long); the last chunk waits for its first proposals;
3. **draft** (``_draft``): each proposer drafts for all its requests in one call, as many tokens as
   the step planner asks (:meth:`~onlinespec.decoding.planner.StepPlanner.asks`: what pays at this
   batch size);
4. **verify** (``_verify_batch``): ONE target forward over every running request's block (its last
   token and its proposals, padded to the step's width, :meth:`~onlinespec.decoding.planner.StepPlanner.verify`);
   :mod:`onlinespec.decoding.verify` accepts a prefix per request and adds one token; each request
   keeps its accepted columns in the cache (the rest become holes,
   :mod:`onlinespec.decoding.batch_cache`), records its trace, and stops where it must
   (``_finish_round``);
5. **join** (``_verify_joining``): a request whose last prompt chunk runs now verifies its first
   proposals in the same forward of its own, then joins the batch cache.

Failures stay with the request that caused them: what raises in its own work (its prompt's
forwards, its verification) finishes it alone with ``error`` set; a proposer that raises drafts
nothing that step (drafts are advice). A batched forward that raises cannot say whose fault it
was: the scheduler recomputes the batch (:meth:`~SpeculativeEngine.recompute`), and the next
step prefills every request alone, where a culprit fails by itself.

With no proposer (or ``k = 0``) the same step is the target alone's autoregressive decoding: the
baseline runs the same code, kernels and batching; one request alone is a batch of one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from onlinespec.decoding.cost_curve import CostCurve
from onlinespec.decoding.grammar import constrain, forced_rows
from onlinespec.decoding.logprobs import score
from onlinespec.decoding.planner import StepPlanner
from onlinespec.decoding.processors import apply_processors
from onlinespec.decoding.proposal import DEFAULT_K, DraftInput, Proposal, trim
from onlinespec.decoding.proposers.base import Proposer
from onlinespec.decoding.request import RequestState, RoundTiming, RoundTrace
from onlinespec.decoding.runners import TargetRunner
from onlinespec.decoding.runners.torch_runner import TorchRunner
from onlinespec.decoding.sampling import logits_to_probs
from onlinespec.decoding.verify import Verdict, verify_greedy, verify_sampling

__all__ = ["DEFAULT_K", "DEFAULT_PREFILL_CHUNK", "MIN_SHARED_PREFILL", "SpeculativeEngine", "StepReport"]  # DEFAULT_K: proposal.py's

DEFAULT_PREFILL_CHUNK = 256
# prompts shorter than this prefill again rather than copy another request's cache: llama.cpp copies a
# sequence's whole cache stream (about 90 MB for the packaged target), which costs about what a prefill
# of a dozen tokens does on a CPU
MIN_SHARED_PREFILL = 16


@dataclass
class StepReport:
    """What one step ran: for the scheduler's metrics and the cost model's checks. The step's
    phases fill it in as they go."""

    batch: int = 0  # requests verified in the batched forward
    width: int = 0  # its block width (before any padding the runner adds)
    context: int = 0  # cache columns it attended over (holes included)
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens emitted by every request of the step
    prefill_tokens: int = 0
    shared_prefill_tokens: int = 0  # prompt positions copied from another request's cache instead of computed
    draft_seconds: float = 0.0
    target_seconds: float = 0.0  # the batched forward
    prefill_seconds: float = 0.0  # prompt forwards (chunks and joining requests)
    seconds: float = 0.0
    failed: list[RequestState] = field(default_factory=list)  # requests this step failed alone (their ``error``)
    own_seconds: dict[int, float] = field(default_factory=dict)  # id(request) -> its forwards of its own (prompt chunks, joining)

    def add_own(self, request: RequestState, seconds: float) -> None:  # a prompt chunk's or a joining forward's
        self.prefill_seconds += seconds
        self.own_seconds[id(request)] = self.own_seconds.get(id(request), 0.0) + seconds

    def add_round(self, proposal: Proposal, accepted: int, request: RequestState) -> None:
        """Count one request's verified round."""
        self.proposed += len(proposal)
        self.accepted += accepted
        self.emitted += len(request.new_tokens)


class SpeculativeEngine:
    """Lossless speculative decoding of a target over a batch of requests."""

    def __init__(
        self,
        target: PreTrainedModel | TargetRunner,
        eos_token_ids: frozenset[int],
        k: int = DEFAULT_K,
        trace_top_k: int = 32,
        cost_curve: CostCurve | None = None,
        pad: bool = True,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        """``target``: the runner that runs it (:mod:`onlinespec.decoding.runners`), or a Hugging
        Face model, run by a :class:`TorchRunner` with ``cost_curve`` and ``pad`` (blocks padded
        to faster widths)."""
        self.planner = StepPlanner(k)  # the step's k decisions: drafted and verified tokens (raises on k < 0)
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        self.runner: TargetRunner = TorchRunner(target, cost_curve, pad) if isinstance(target, torch.nn.Module) else target
        self.eos_token_ids, self.trace_top_k = eos_token_ids, trace_top_k
        self.prefill_chunk = prefill_chunk
        self.draft_failures = 0  # proposer calls that raised (their requests went on undrafted)
        self.shared_prefill_tokens = 0  # prompt positions copied from another request's cache (_share_prompt)
        self._paced: set[int] = set()  # the step's requests whose prefill runs on their credit (_paced_room)
        self._idle: frozenset[int] = frozenset()  # the step's requests that sit it out (step's idle)

    @property
    def k(self) -> int:
        """The most proposals per round (the planner's)."""
        return self.planner.k

    @property
    def context(self) -> int:
        """The target's context window in tokens."""
        return self.runner.context

    def budget(self, prompt_tokens: int, max_new_tokens: int | None = None, name: str = "max_new_tokens") -> int:
        """The new tokens a request with this prompt gets: ``max_new_tokens``, or all the context
        leaves (None). A verification block reaches k + 1 positions past the text and must fit: a
        ``ValueError`` when the prompt leaves no room or the budget overruns it (``name``: the
        caller's word for it). The capacity and stop checks (``StopChecker``) use this one answer."""
        room = self.context - prompt_tokens - (self.k + 1)
        if room < 1 or (max_new_tokens is not None and max_new_tokens > room):
            asked = "" if max_new_tokens is None else f" + {name} ({max_new_tokens})"
            raise ValueError(f"prompt ({prompt_tokens} tokens){asked} exceeds the model's context of {self.context} tokens: "
                             f"ask for at most {max(room, 0)} new tokens for this prompt"
                             + ("" if room > 0 else f", or shorten the prompt to at most {self.context - self.k - 2} tokens"))
        return room if max_new_tokens is None else max_new_tokens

    def reset(self) -> None:
        """Drop every request's cache rows (after a step that failed half-way)."""
        self.runner.reset()

    def recompute(self, requests: list[RequestState]) -> None:
        """After a batched forward that raised: drop every cache row, and let ``requests`` (those
        still running) prefill their text again at the next step, one forward each, where a
        request that breaks the target fails alone (:meth:`RequestState.recompute`)."""
        self.runner.reset()
        for r in requests:
            r.recompute()

    # ---- one step -------------------------------------------------------------------------

    def parkable_rows(self) -> list[RequestState]:  # the batch's rows if one sitting a step out costs it nothing
        return list(self.runner.rows) if self.runner.idle_rows_free else []

    @torch.inference_mode()
    def step(self, active: list[RequestState], idle: frozenset[int] = frozenset()) -> StepReport:
        """Advance every unfinished request of ``active`` by one round (or one prefill chunk); those
        in ``idle`` sit it out (:mod:`onlinespec.decoding.step_shares`): rows keep their caches and
        decode nothing, unless no other row would; prompts neither prefill nor earn credit."""
        start = time.perf_counter()
        self._leave(active)
        decoding: list[RequestState] = [r for r in self.runner.rows if id(r) not in idle] or list(self.runner.rows)
        report = StepReport(batch=len(decoding))
        self._paced, self._idle = set(), idle
        joining = self._admit(active, report)
        for r in active:
            r.new_tokens = []
        tick = time.perf_counter()
        rows = joining + decoding
        asks = self.planner.asks(joining, decoding, self.runner.columns)
        forced = forced_rows(rows, asks, self.k)  # a grammar's forced tokens: those rows call no draft
        lookups = [0 if i in forced else n for i, n in enumerate(self.planner.lookups(rows, asks))]
        proposals = self._draft(rows, asks, lookups)
        proposals = constrain(rows, proposals, forced, self.k)
        report.draft_seconds = time.perf_counter() - tick
        report.context = self.runner.columns
        if decoding:
            self._verify_batch(decoding, proposals[len(joining):], report)
            self._credit(active, decoding + joining, report.target_seconds / len(decoding))
        self._verify_joining(joining, proposals[: len(joining)], report)
        self.runner.release([r for r in self.runner.rows if r.finished])
        report.seconds = time.perf_counter() - start
        return report

    # ---- the parts of a step ----------------------------------------------------------------

    def _leave(self, active: list[RequestState]) -> None:
        """Rows of requests that finished or were dropped leave the batch cache, and each learned
        proposer takes the draft the online learner handed over: between steps, so that a step
        drafts with one draft throughout."""
        keep = {id(r) for r in active if not r.finished}
        self.runner.release([r for r in self.runner.holding() if id(r) not in keep])
        for proposer in {id(r.proposer): r.proposer for r in active if r.proposer is not None}.values():
            if proposer.swappable:
                proposer.take_swap()

    def _admit(self, active: list[RequestState], report: StepReport) -> list[RequestState]:
        """Run the prompt chunks of requests not in the batch yet, in ``active``'s (fair) order;
        return those whose last chunk fits (they verify in this step, in forwards of their own).
        While the batch holds rows, at most ``prefill_chunk`` tokens run in all; on an empty batch
        every prompt that fits a chunk joins at once, and of longer ones a chunk a step (a 4k-token
        prompt alone took a step of minutes: issue 46). A request prefills at most what its
        tenant's share of the step leaves (``prefill_share``); past it, one row's block (k + 1
        tokens) when its credit covers the block's cost (:meth:`_paced_room`)."""
        running = {id(r) for r in self.runner.rows}  # sitting the step out or not
        budget = self.prefill_chunk if running else None  # None: nobody decodes
        joining, filling = [], []
        for r in active:
            if r.finished or id(r) in running or id(r) in self._idle:
                continue
            self._share_prompt(r, report)
            if _may_share(r) and any(o.prompt_ids == r.prompt_ids for o in filling):
                continue  # another choice of its prompt is prefilling it: copy its cells once it holds them
            rest, share = len(r.ids) - r.prefilled, r.prefill_share
            room = self.prefill_chunk if budget is None else budget
            paced = share is not None and share[0] <= 0
            if share is not None:
                room = min(room, self._paced_room(r, rest) if paced else max(share[0], self.k + 1))
            if rest <= room:
                joining.append(r)
                spent = rest
                if paced:  # its forward's seconds come off its credit (_verify_joining)
                    self._paced.add(id(r))
            elif room > 0 and not (budget is None and filling):  # a chunk that does not reach the end of the prompt
                self._prefill(r, r.ids[r.prefilled: r.prefilled + room], report)
                filling.append(r)
                spent = room
                if paced:  # what the chunk's forward took (_prefill measured it)
                    r.prefill_credit -= room * r.prefill_rate
            else:
                filling.append(r)
                continue
            budget = None if budget is None else budget - spent
            if share is not None:
                share[0] -= spent
        return joining

    def _credit(self, active: list[RequestState], placed: list[RequestState], row: float) -> None:
        """Each request still prefilling past its tenant's share earns ``row`` seconds (what one
        more row of the batch cost this step) of credit, at most one block's worth banked."""
        skip = {id(r) for r in placed} | self._idle  # placed this step, or sitting it out
        for r in active:
            if not r.finished and id(r) not in skip and r.prefill_share is not None and r.prefill_share[0] <= 0:
                r.prefill_credit = min(r.prefill_credit + row, row + (self.k + 1) * r.prefill_rate)

    def _paced_room(self, r: RequestState, rest: int) -> int:
        """What a request past its tenant's share may prefill this step: one row's block (k + 1
        tokens, or the ``rest`` of its text) when its credit covers that at its last chunk's rate,
        else nothing. Its credit grows by one batch row's seconds each step it waits (:meth:`step`),
        so while past its share its prefill costs the others' steps what one more row of its own
        would: a 4k-token prompt scored a chunk at a time after 3,000 cached tokens (on this CPU
        0.1 s a chunk, ten rows' time) no longer lengthens every step (issue 46)."""
        block = min(rest, self.k + 1)
        return block if r.prefill_credit >= block * r.prefill_rate else 0

    def _prefill(self, r: RequestState, chunk: list[int], report: StepReport) -> None:
        """One prompt chunk into the request's cache: no logits needed, unless the request asked
        for its prompt's log probabilities (then every position's, scored at once)."""
        tick = time.perf_counter()
        try:
            if r.params.prompt_logprobs is not None:
                logits, _ = self.runner.forward_alone(r, chunk, len(chunk))
                _score_prompt(r, logits, r.prefilled)
            else:
                self.runner.prefill(r, chunk)
        except Exception as err:
            self._failed(r, err, report)
            self.runner.release([r])
            return
        seconds = time.perf_counter() - tick
        report.add_own(r, seconds)
        r.prefill_rate = seconds / len(chunk)
        r.prefilled += len(chunk)
        report.prefill_tokens += len(chunk)

    def _verify_batch(self, decoding: list[RequestState], proposals: list[Proposal], report: StepReport) -> None:
        """ONE target forward over every running request's block (its last token and its
        proposals); each row verifies its own and keeps the columns it accepted."""
        report.width, proposals = self.planner.verify(decoding, proposals, 1, report.context)
        blocks = {id(r): r.ids[-1:] + p.tokens for r, p in zip(decoding, proposals)}
        rows, tick = self.runner.rows, time.perf_counter()  # a row not decoding this step gets no block: it sits out
        logits, hidden = self.runner.forward([blocks.get(id(r), []) for r in rows])
        if not any(_uses_features(r) for r in decoding):
            hidden = None
        report.target_seconds = time.perf_counter() - tick
        place = {id(r): b for b, r in enumerate(rows)}
        kept = dict.fromkeys(place, 0)
        for r, proposal in zip(decoding, proposals):
            b = place[id(r)]
            timing = RoundTiming(len(proposal), report.draft_seconds, report.target_seconds, len(decoding), proposal.drafter)
            try:
                n_accepted = self._finish_round(r, proposal, logits[b], hidden[b] if hidden is not None else None, timing)
            except Exception as err:  # this row's verification: it fails alone, released at the end of the step
                self._failed(r, err, report)
                n_accepted = 0
            kept[id(r)] = 1 + n_accepted
            report.add_round(proposal, n_accepted, r)
        self.runner.commit([kept[id(r)] for r in rows])

    def _verify_joining(self, joining: list[RequestState], proposals: list[Proposal], report: StepReport) -> None:
        """Requests whose last prompt chunk runs now: prefill and first verification share a
        forward of their own; then each joins the batch cache (or leaves, finished or failed)."""
        for r, proposal in zip(joining, proposals):
            self._share_prompt(r, report)
            rest = r.ids[r.prefilled:]  # the prompt, or all the text of a request recomputed
            proposal = self.planner.verify([r], [proposal], len(rest))[1][0]
            try:
                n_accepted = self._prefill_and_verify(r, rest, proposal, report)
            except Exception as err:  # its own forward or verification: it fails alone
                self._failed(r, err, report)
                self.runner.release([r])
                continue
            report.add_round(proposal, n_accepted, r)
            if r.finished:
                self.runner.release([r])
            else:
                self.runner.join(r, r.prefilled + n_accepted)

    def _share_prompt(self, r: RequestState, report: StepReport) -> None:
        """A new request whose prompt another request in the runner holds (the ``n`` choices of
        one prompt) copies that cache instead of computing it again, when the runner can: all of
        the prompt but its last token, which runs with the request's first proposals. A preempted
        request starts from its own cells, when the runner's prefix cache kept them as it left."""
        if not r.prefilled and len(r.ids) > len(r.prompt_ids) and r.params.prompt_logprobs is None:
            self._reuse_prefix(r, report)
            return
        if not _may_share(r):
            return
        shared = len(r.prompt_ids) - 1
        donor = next((d for d in self.runner.holding() if d is not r and d.prompt_ids == r.prompt_ids and not d.finished), None)
        if donor is not None and self.runner.fork(donor, r, shared):
            r.prefilled = shared
            report.shared_prefill_tokens += shared
            self.shared_prefill_tokens += shared
            return
        self._reuse_prefix(r, report)

    def _reuse_prefix(self, r: RequestState, report: StepReport) -> None:
        """A new prompt starts from the cells of the longest prefix an earlier request of its key
        left in the runner's prefix cache (:mod:`onlinespec.decoding.prefix_cache`; llama.cpp
        only), counted once as a query of its prompt's tokens, and its hit as cached tokens. A
        preempted request looks up its whole text (its own cells, as it left the batch), at each
        step until it prefills: its prefill again is a copy, not a recomputation (issue 46)."""
        reuse, again = getattr(self.runner, "reuse", None), len(r.ids) > len(r.prompt_ids)
        if reuse is None or r.cache_key is None or (r.stats.prefix_queried and not again):
            return
        reused = reuse(r, r.ids if again else r.prompt_ids, MIN_SHARED_PREFILL)
        if reused is None:  # the runner keeps no prefix cache
            return
        if not again:
            r.stats.prefix_queried = len(r.prompt_ids)
            r.stats.cached_tokens = reused
        if reused:
            r.prefilled = reused
            report.shared_prefill_tokens += reused
            self.shared_prefill_tokens += reused

    def _prefill_and_verify(self, r: RequestState, rest: list[int], proposal: Proposal, report: StepReport) -> int:
        """One joining request's forward: the ``rest`` of its text not cached yet and its
        proposals; return how many it accepted."""
        cached = len(r.ids)
        scored = len(rest) - 1 if r.params.prompt_logprobs is not None and cached == len(r.prompt_ids) else 0
        tick = time.perf_counter()
        logits, hidden = self.runner.forward_alone(r, rest + proposal.tokens, scored + len(proposal) + 1)
        if scored:  # the prompt's last positions score its last tokens; the rest is the round's block
            _score_prompt(r, logits[:scored], r.prefilled)
            logits, hidden = logits[scored:], hidden[scored:] if hidden is not None else None
        if hidden is not None:
            if cached == len(r.prompt_ids):
                r.add_prompt_states(hidden[:1])  # the prompt's last position
            hidden = hidden if _uses_features(r) else None
        seconds = time.perf_counter() - tick
        report.add_own(r, seconds)
        report.prefill_tokens += len(rest)
        r.prefill_rate = seconds / len(rest + proposal.tokens)
        if id(r) in self._paced:
            r.prefill_credit -= seconds
        r.prefilled = cached
        return self._finish_round(r, proposal, logits, hidden, RoundTiming(len(proposal), report.draft_seconds, seconds, 1, proposal.drafter))

    @staticmethod
    def _failed(r: RequestState, err: Exception, report: StepReport) -> None:
        logging.getLogger("onlinespec.engine").exception("request %s failed in a step; the others go on", r.id)
        r.error = f"{type(err).__name__}: {err}"
        report.failed.append(r)

    def _draft(self, rows: list[RequestState], asks: list[int], lookups: list[int]) -> list[Proposal]:
        """Each proposer drafts for all its requests in one call, ``asks[i]`` tokens for ``rows[i]``;
        then, in one more call, free lookups of ``lookups[i]`` tokens where it can draft free."""
        proposals = [Proposal() for _ in rows]
        for free, counts in ((False, asks), (True, lookups)):
            groups: dict[int, list[int]] = {}
            for i, r in enumerate(rows):
                if counts[i] > 0 and (not free or r.proposer.free_drafts):
                    groups.setdefault(id(r.proposer), []).append(i)
            for members in groups.values():
                drafted = self._propose(rows[members[0]].proposer, [rows[i] for i in members], [counts[i] for i in members], free)
                for i, proposal in zip(members, drafted):
                    proposals[i] = proposal
        return proposals

    def _propose(self, proposer: Proposer, requests: list[RequestState], asks: list[int], free: bool = False) -> list[Proposal]:
        """One proposer's call for its requests (``free``: its lookups only), timed for the planner;
        nothing if it raises (drafts are advice: these requests are verified without proposals this step)."""
        inputs = [DraftInput(r.ids, k, r.params, r.generator, r.draft_state, with_probs=r.trace is not None,
                             adaptive=None if r.fixed_k else r.adaptive, tenant=r.tenant)
                  for r, k in zip(requests, asks)]
        tick = time.perf_counter()
        try:
            drafted = proposer.propose_free(inputs) if free else proposer.propose(inputs)
        except Exception:
            logging.getLogger("onlinespec.engine").exception("proposer %s failed; its requests go on undrafted", proposer.name)
            self.draft_failures += 1
            return []
        drafted = [trim(proposal, k) for proposal, k in zip(drafted, asks)]  # never more than asked, whatever the proposer did
        if not free:  # what a model's draft step costs, which lookups say nothing about
            self.planner.drafted(proposer, time.perf_counter() - tick, asks)
        return drafted

    def _finish_round(self, r: RequestState, proposal: Proposal, logits: torch.Tensor, hidden: torch.Tensor | None, timing: RoundTiming) -> int:
        """Verify one request's block, record what it saw, emit its tokens; return the accepted count."""
        n = len(proposal)
        logits = logits[: n + 1]
        verdict = _verify(proposal, logits, r)
        if r.trace is not None:
            r.trace.append(self._trace(len(r.ids), proposal, logits, verdict, hidden))
        if r.adaptive is not None and n and proposal.drafter != "grammar":  # forced tokens say nothing of the draft
            r.adaptive.update(proposal, verdict.n_accepted, r.params.greedy)
            if r.own_adaptive is not None:  # a seeded request's own rounds (planner.own_ask)
                r.own_adaptive.update(proposal, verdict.n_accepted, False)
        if hidden is not None and r.proposer is not None:  # the state at the last accepted position: what the next draft step reads
            r.proposer.observe(r.draft_state, hidden[verdict.n_accepted])  # (a step's rows share hidden states; the target alone reads none)
        new = r.stop.clip(proposal.tokens[: verdict.n_accepted] + [verdict.next_token])
        r.ids.extend(new)
        r.new_tokens = new
        if r.params.logprobs is not None:  # row i scores the round's i-th token: the target's own, raw
            r.logprobs.extend(score(logits, new, r.params.logprobs))
        stats = r.stats
        stats.add_round(n, verdict.n_accepted, timing, proposal.drafter)
        stats.new_tokens = len(r.stop.generated)
        stats.seconds = time.perf_counter() - r.submitted
        if not stats.first_token_seconds:
            stats.first_token_seconds = stats.seconds
        stats.finish_reason = r.stop.finish_reason
        return verdict.n_accepted

    def _trace(self, position: int, proposal: Proposal, logits: torch.Tensor, verdict: Verdict, hidden: torch.Tensor | None) -> RoundTrace:
        # top-K of the raw logits minus their log-sum-exp: no vocabulary-sized log-softmax row
        top = logits.float().topk(min(self.trace_top_k, logits.shape[-1]), dim=-1)
        values = top.values - torch.logsumexp(logits.float(), -1, keepdim=True)
        draft_probs = proposal.confidences or None  # a greedy head: q(x_i) of its own choice, at temperature 1
        if proposal.probs is not None:
            draft_probs = proposal.probs[torch.arange(len(proposal)), torch.tensor(proposal.tokens, dtype=torch.long)].tolist()
        kept = hidden[: len(proposal) + 1].to(torch.float16) if hidden is not None else None
        return RoundTrace(position, list(proposal.tokens), draft_probs, top.indices, values, verdict.n_accepted, verdict.next_token, kept)


def _verify(proposal: Proposal, logits: torch.Tensor, r: RequestState) -> Verdict:
    if not logits.max() < float("inf"):  # NaN (max propagates it) or +inf: a broken model, never emit a token from it
        raise FloatingPointError("the target's logits hold NaN or +inf (broken weights, or an overflow in this dtype): "
                                 "no token was emitted from them; check the model, or serve it in float32")
    if r.params.processed:  # each row with its own history: the output so far and the proposals before it
        out = r.stop.generated
        logits = apply_processors(logits, r.params, r.prompt_ids, out + proposal.tokens, len(out), r.stop.held_back)
    if r.grammar is None:
        return _accept(proposal, logits, r)
    logits, taken = r.grammar.mask(logits, proposal.tokens)  # each row masked to what the grammar allows there (docs/engine.md)
    verdict = _accept(proposal, logits, r)
    r.grammar.advance(taken, verdict.n_accepted, verdict.next_token)
    return verdict


def _accept(proposal: Proposal, logits: torch.Tensor, r: RequestState) -> Verdict:
    if r.params.greedy:
        return verify_greedy(proposal.tokens, logits)
    return verify_sampling(proposal.tokens, proposal.probs, logits_to_probs(logits, r.params), r.generator)


def _score_prompt(r: RequestState, logits: torch.Tensor, start: int) -> None:
    """Rows for positions ``start..`` of the prompt score its tokens at ``start + 1..`` (once:
    a request recomputed after a failed step does not score its prompt again)."""
    if len(r.prompt_logprobs) == start + 1:
        r.prompt_logprobs.extend(score(logits, r.prompt_ids[start + 1: start + 1 + len(logits)], r.params.prompt_logprobs))


def _may_share(r: RequestState) -> bool:
    """Whether ``r`` may start from another request's cells of its prompt: a new, unscored request
    whose prompt is long enough to be worth the copy."""
    return not r.prefilled and len(r.ids) == len(r.prompt_ids) and len(r.prompt_ids) - 1 >= MIN_SHARED_PREFILL and r.params.prompt_logprobs is None


def _uses_features(r: RequestState) -> bool:
    """Whether the request's proposer reads the target's hidden states (the target alone reads none)."""
    return r.proposer is not None and r.proposer.uses_features
