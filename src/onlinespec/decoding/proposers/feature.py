"""Proposals from a feature-conditioned head (:mod:`onlinespec.decoding.feature_head`), for a batch.

The engine hands the proposer the target's post-norm hidden state at each request's last verified
position after every round (:meth:`observe`, kept in the request's :class:`HeadState`); the head
chains ``k`` steps from it, for every request of the batch in one matrix product per step. Until
a request's first verification (its prefill) there is no feature, so its round 0 proposes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from onlinespec.decoding.feature_head import FeatureHead, served_copy
from onlinespec.decoding.proposal import DraftInput, Proposal
from onlinespec.decoding.proposers.base import ModelSlot, SwappableDraft
from onlinespec.decoding.sampling import logits_to_probs, sample
from onlinespec.memory import OwnBytes


@dataclass
class HeadState:
    feature: torch.Tensor | None = None  # the target's feature at the request's last verified position


class FeatureHeadProposer(SwappableDraft):
    drafter = "head"
    uses_features = True  # it chains from the target's feature, handed over by observe

    def __init__(self, head: FeatureHead, name: str = "feature-head", version: str = "v0") -> None:
        self.name = name
        self.slot = ModelSlot(head.eval(), version)  # the float32 head (the one the learner copies and trains)
        self._served: tuple[FeatureHead, FeatureHead] | None = None  # (that head, its int8 serving copy)
        self._prepared: tuple[FeatureHead, FeatureHead] | None = None  # the same for the head offered last

    @property
    def head(self) -> FeatureHead:
        """The head that drafts: the serving copy (:func:`served_copy`) of the slot's head."""
        model, served = self.slot.model, self._served
        if served is None or served[0] is not model:
            ready = self._prepared
            served = self._served = ready if ready is not None and ready[0] is model else (model, served_copy(model))
        return served[1]

    def swap_model(self, head: FeatureHead, version: str) -> None:
        """Hand over a new head; its serving copy is made here, on the caller's thread (the
        learner's), so the engine's step does not pay for it."""
        self._prepared = (head.eval(), served_copy(head))
        super().swap_model(head, version)

    def memory_objects(self) -> list:
        """The float head and its int8 serving copies: their own float tensors, and their packed
        int8 matrices as :func:`served_copy` measured them (never unpacked here: this runs each
        time /metrics is read)."""
        copies = list({id(p[1]): p[1] for p in (self._served, self._prepared) if p is not None}.values())
        return [self.slot.model, *copies, *(OwnBytes(getattr(served, "packed_bytes", 0)) for served in copies)]

    def start(self, prompt_ids: list[int]) -> HeadState:
        return HeadState()

    def observe(self, state: HeadState, feature: torch.Tensor) -> None:
        """The target's post-norm hidden state at the request's last verified position."""
        state.feature = feature

    @torch.inference_mode()
    def propose(self, batch: Sequence[DraftInput]) -> list[Proposal]:
        out = [Proposal() for _ in batch]
        live = [i for i, d in enumerate(batch) if d.k > 0 and d.state is not None and d.state.feature is not None]
        if not live:
            return out
        start = time.perf_counter()
        head = self.head
        feature = torch.stack([batch[i].state.feature for i in live]).float()
        token = torch.tensor([batch[i].ids[-1] for i in live])
        tokens = [[] for _ in live]
        confidences = [[] for _ in live]
        rows = [[] for _ in live]  # sampling only: the greedy trace's q(x_i) is in the confidences
        for step in range(max(batch[i].k for i in live)):
            feature = head.step(feature, token)
            logits = head.logits(feature)
            greedy_probs = logits.softmax(-1)
            picks = greedy_probs.argmax(-1).tolist()
            for row, i in enumerate(live):
                d = batch[i]
                if step >= d.k:
                    continue
                probs = greedy_probs[row]
                if not d.params.greedy:
                    probs = logits_to_probs(logits[row], d.params)
                    picks[row] = sample(probs, d.generator)
                    rows[row].append(probs)
                confidences[row].append(float(probs[picks[row]]))
                tokens[row].append(int(head.vocab_ids[picks[row]]))
            token = head.vocab_ids[torch.tensor(picks)]
        seconds = time.perf_counter() - start
        vocab = head.config.vocab_size or int(head.restricted_index.shape[0])
        for row, i in enumerate(live):
            probs = None
            if rows[row]:  # back onto the target's vocabulary: ids outside V_r get probability 0
                restricted = torch.stack(rows[row])
                probs = restricted.new_zeros(len(restricted), vocab)
                probs[:, head.vocab_ids] = restricted
            out[i] = Proposal(tokens[row], probs, seconds, confidences=confidences[row], drafter=self.drafter)
        return out
