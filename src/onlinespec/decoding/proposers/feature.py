"""Proposals from a feature-conditioned head (:mod:`onlinespec.drafts.feature_head`).

The engine hands the proposer the target's post-norm hidden state at the last verified position
after every round (:meth:`observe`); the head chains ``k`` steps from it. Until the first
verification (the prefill) there is no feature, so round 0 proposes nothing.
"""

from __future__ import annotations

import time

import torch

from onlinespec.decoding.proposers.base import Proposal
from onlinespec.decoding.sampling import SamplingParams, logits_to_probs, sample
from onlinespec.drafts.feature_head import FeatureHead


class FeatureHeadProposer:
    uses_features = True

    def __init__(self, head: FeatureHead, name: str = "feature-head", version: str = "v0") -> None:
        self.head, self.name, self.version = head.eval(), name, version
        self._incoming: tuple[FeatureHead, str] | None = None
        self._feature: torch.Tensor | None = None

    def begin(self, prompt_ids: list[int]) -> None:
        self._take_incoming()
        self._feature = None

    def observe(self, feature: torch.Tensor) -> None:
        """The target's post-norm hidden state at the last verified position."""
        self._feature = feature

    @property
    def model(self) -> FeatureHead:
        """The serving head (the online learner copies and swaps it)."""
        return self.head

    def swap_model(self, head: FeatureHead, version: str) -> None:
        """Hand over a new head; safe from another thread, taken at the start of a round."""
        self._incoming = (head.eval(), version)

    def _take_incoming(self) -> None:
        incoming, self._incoming = self._incoming, None
        if incoming is not None:
            self.head, self.version = incoming

    @torch.inference_mode()
    def propose(
        self,
        ids: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        with_probs: bool = False,
    ) -> Proposal:
        self._take_incoming()
        if self._feature is None or k <= 0:
            return Proposal()
        start = time.perf_counter()
        head = self.head
        feature, token = self._feature.float(), torch.tensor(ids[-1])
        tokens, confidences, rows = [], [], []
        # greedy: the trace's q(x_i) is in the confidences, so full rows are built only to sample
        keep_probs = not params.greedy
        for _ in range(k):
            feature = head.step(feature, token)
            logits = head.logits(feature)
            if params.greedy:
                probs = logits.softmax(-1)
                index = int(probs.argmax())
            else:
                probs = logits_to_probs(logits, params)
                index = sample(probs, generator)
            confidences.append(float(probs[index]))
            token = head.vocab_ids[index]
            tokens.append(int(token))
            if keep_probs:
                rows.append(probs)
        probs = None
        if rows:  # back onto the target's vocabulary: ids outside V_r get probability 0
            restricted = torch.stack(rows)
            probs = restricted.new_zeros(len(rows), head.config.vocab_size or int(head.restricted_index.shape[0]))
            probs[:, head.vocab_ids] = restricted
        return Proposal(tokens, probs, time.perf_counter() - start, confidences=confidences, source="head")
