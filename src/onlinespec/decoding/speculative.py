"""Lossless speculative decoding with KV caches, for one request or many at once.

:class:`SpeculativeDecoder` is the front of the engine: ``generate`` and ``stream`` serve one
request (a batch of one), ``generate_many`` serves a list with up to ``max_batch`` in flight
(continuous batching, :mod:`onlinespec.decoding.scheduler`). Every path runs the same step
(:mod:`onlinespec.decoding.engine`): the proposer drafts up to ``k`` tokens per request, the target
runs ONE forward over every request's block, :mod:`onlinespec.decoding.verify` accepts a prefix per
request and adds one token. With no proposer (or ``k = 0``) it is the target alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from transformers import PreTrainedModel

from onlinespec.decoding.adaptive import AdaptiveK
from onlinespec.decoding.cost_curve import CostCurve
from onlinespec.decoding.engine import DEFAULT_K, DEFAULT_PREFILL_CHUNK, SpeculativeEngine, StepReport
from onlinespec.decoding.proposers.base import Proposer
from onlinespec.decoding.request import Generation, RequestState, RequestStats, RoundTiming, RoundTrace, StreamChunk
from onlinespec.decoding.runners import TargetRunner
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.scheduler import DEFAULT_MAX_BATCH, Scheduler
from onlinespec.decoding.stopping import StopChecker
from onlinespec.tokens import Prompt, encode_prompt
from onlinespec.tokens import eos_token_ids as _eos

__all__ = ["Generation", "RequestStats", "RoundTiming", "RoundTrace", "SpeculativeDecoder", "StreamChunk", "encode_prompt"]


class SpeculativeDecoder:
    """Lossless speculative decoding of ``target`` with drafts from ``proposer``.

    >>> decoder = SpeculativeDecoder(target, tokenizer, DraftModelProposer(draft), k=4)
    >>> out = decoder.generate("Write a haiku", SamplingParams(max_new_tokens=64))
    >>> out.text, out.stats.acceptance_rate
    >>> outs = decoder.generate_many(prompts, SamplingParams(max_new_tokens=64), max_batch=8)
    """

    def __init__(
        self,
        target: PreTrainedModel | TargetRunner,
        tokenizer=None,
        proposer: Proposer | None = None,
        k: int = DEFAULT_K,
        trace_top_k: int = 32,
        adaptive_k: AdaptiveK | None = None,
        cost_curve: CostCurve | None = None,
        pad: bool = True,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        max_batch: int = DEFAULT_MAX_BATCH,
        eos_token_ids: frozenset[int] | None = None,
    ) -> None:
        """``adaptive_k``: the draft's acceptance statistics and the target's cost curve; each
        step then verifies only as many proposals as pay at its batch size
        (:mod:`onlinespec.decoding.adaptive`); default: all of them. ``cost_curve`` (default:
        the one in ``adaptive_k``) with ``pad`` runs blocks at the fastest wider width
        (:mod:`onlinespec.decoding.calibrate`). ``target``: a Hugging Face model (run by torch) or a
        runner (:mod:`onlinespec.decoding.runners`: its own padding; then give ``eos_token_ids``)."""
        self.target, self.tokenizer, self.proposer = target, tokenizer, proposer
        self.adaptive_k = adaptive_k
        self.max_batch = max_batch
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else _eos(target, tokenizer)
        curve = cost_curve or (adaptive_k.curve if adaptive_k is not None else None)
        self.engine = SpeculativeEngine(target, self.eos_token_ids, k if proposer is not None else 0, trace_top_k,
                                        curve, pad, prefill_chunk)

    @property
    def k(self) -> int:
        return self.engine.k

    # ---- one request ------------------------------------------------------------------------

    def request(self, prompt: Prompt, params: SamplingParams = SamplingParams(), trace: bool = False,
                proposer: Proposer | None = None, adaptive_k: AdaptiveK | None = None) -> RequestState:
        """A new request's state (not started): the decoder's draft and its statistics, unless
        ``proposer`` (with its own ``adaptive_k``) is given."""
        if proposer is None:
            proposer, adaptive_k = self.proposer, self.adaptive_k
        ids = self.encode(prompt)
        budget = self.engine.budget(len(ids), params.max_new_tokens)
        return RequestState(ids, params, StopChecker(params, self.eos_token_ids, self.tokenizer, max_new_tokens=budget),
                            proposer=proposer, adaptive=adaptive_k, trace=[] if trace else None)

    def generate(self, prompt: Prompt, params: SamplingParams = SamplingParams(), trace: bool = False) -> Generation:
        """Decode one request to the end. ``prompt``: text, chat messages, or token ids."""
        return self.generate_many([prompt], params, trace=trace, max_batch=1)[0]

    def stream(self, prompt: Prompt, params: SamplingParams = SamplingParams()) -> Iterator[StreamChunk]:
        """Yield each round's tokens and the text they complete, as soon as the round is verified."""
        if self.tokenizer is None:
            raise ValueError("streaming text needs a tokenizer")
        request = self.request(prompt, params)
        scheduler = Scheduler(self.engine, 1)
        scheduler.submit(request)
        emitted = ""
        while scheduler.has_work:
            scheduler.step()
            if request.error is not None:
                raise RequestFailed(f"the request failed: {request.error}", [self._generation(request)], [0])
            if not request.new_tokens and not request.finished:
                continue  # a prompt chunk: nothing to show yet
            delta, emitted = text_delta(request, emitted)
            yield StreamChunk(request.new_tokens, delta, request.stats if request.finished else None)

    # ---- many requests --------------------------------------------------------------------

    def generate_many(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        trace: bool = False,
        max_batch: int | None = None,
        on_finish: Callable[[int, Generation], None] | None = None,
        on_step: Callable[[StepReport], None] | None = None,
    ) -> list[Generation]:
        """Serve ``prompts`` with up to ``max_batch`` in flight (default: the decoder's); a new
        request enters as soon as one finishes. Returns the generations in the prompts' order.
        ``on_finish(index, generation)`` as each ends; ``on_step(report)`` after every step."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling parameters")
        requests = [self.request(p, sp, trace) for p, sp in zip(prompts, params_list)]
        scheduler = Scheduler(self.engine, max_batch or self.max_batch)
        for r in requests:
            scheduler.submit(r)
        index = {id(r): i for i, r in enumerate(requests)}
        out: list[Generation | None] = [None] * len(requests)
        while scheduler.has_work:
            advanced, report = scheduler.step()
            if on_step and report is not None:
                on_step(report)
            for r in advanced:
                if r.finished and out[index[id(r)]] is None:
                    out[index[id(r)]] = self._generation(r)
                    if on_finish and r.error is None:
                        on_finish(index[id(r)], out[index[id(r)]])
        failed = [i for i, r in enumerate(requests) if r.error is not None]
        if failed:
            raise RequestFailed(f"{len(failed)} of {len(requests)} requests failed (the others finished): prompt {failed[0]}: "
                                f"{requests[failed[0]].error}", out, failed)
        return out

    def _generation(self, r: RequestState) -> Generation:
        text = r.stop.text() if self.tokenizer is not None else ""
        return Generation(text, list(r.stop.generated), r.prompt_ids, r.stats, r.trace or [],
                          r.logprobs if r.params.logprobs is not None else None, r.prompt_logprobs or None)

    def encode(self, prompt: Prompt) -> list[int]:
        needs_tokenizer = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))
        if needs_tokenizer and self.tokenizer is None:
            raise ValueError("this decoder has no tokenizer: pass token ids, or build it with one")
        return encode_prompt(self.tokenizer if needs_tokenizer else None, prompt, self.engine.runner.vocab_size)


class RequestFailed(RuntimeError):
    """Requests that failed alone inside a step (their ``error``); ``generations`` holds every
    request's generation (the failed ones as far as they got), ``failed`` their indices."""

    def __init__(self, message: str, generations: list[Generation], failed: list[int]) -> None:
        super().__init__(message)
        self.generations, self.failed = generations, failed


def text_delta(request: RequestState, emitted: str) -> tuple[str, str]:
    """(the text a request's last step adds to ``emitted``, the text emitted after it): a
    partial character, or what may be the start of a stop string, waits for the next step.
    Reads only the new text (and the last characters a stop string could start in)."""
    if request.finished:
        text = request.stop.text()
        return text[len(emitted):], max(emitted, text, key=len)
    delta = request.stop.text_between(len(emitted), request.stop.streamable())
    return delta, emitted + delta
