"""One interface for every way of drafting (small LM, n-gram lookup, feature head, hybrid).

A proposer drafts for a batch of requests at once (:meth:`Proposer.propose`); what it keeps
about one request between rounds (a draft KV cache, the target feature it chains from) lives in
that request's *draft state*, made by :meth:`Proposer.start`, never in the proposer: one proposer
serves every request that uses its draft. A state must notice by itself when the engine discarded
some proposals, by comparing the ids it is given with what it has seen.

A learned proposer's model sits in a :class:`ModelSlot`: the online learner hands a new one over
from its own thread, and the engine takes it between steps, so a step sees one draft throughout.

What a proposer can do (read the target's features, have its model swapped, learn through a
suffix index) is declared on :class:`Proposer` with a default and overridden where it holds, so
the engine, the pool and the server read an attribute instead of probing the object.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from onlinespec.decoding.proposal import DraftInput, Proposal

__all__ = ["DraftInput", "ModelSlot", "PerRequestProposer", "Proposal", "Proposer", "SwappableDraft"]  # the values live in proposal.py


class Proposer:
    """The base of every drafter: how the engine calls it, and what it declares it can do."""

    name: str = "draft"  # for logs, metrics and the registry (each drafter names itself)
    drafter: str = "draft"  # the ``Proposal.drafter`` of what it drafts itself
    # Wants the target's post-norm hidden state at each request's last verified position: the
    # engine then keeps the batched forward's hidden states and calls :meth:`observe`.
    uses_features: bool = False
    # Its model sits in a ModelSlot the online learner replaces (SwappableDraft): it can learn.
    swappable: bool = False
    # The SuffixIndex of earlier requests it drafts from (proposers.suffix, which imports this
    # module): it learns from every request served, model-free.
    suffix_index: Any = None
    version: str | None = None  # the serving model's version (a swappable draft's slot has one)
    # It can draft at no model cost (:meth:`propose_free`: lookups in the text or an index).
    free_drafts: bool = False
    # The drafter whose draft steps cost (a hybrid's learned draft), when it also drafts for free:
    # the step budget prices that one's measured acceptance alone. None: all it drafts.
    paid_drafter: str | None = None

    def start(self, prompt_ids: list[int]) -> Any:
        """A new request starts: its draft state (``None`` when the proposer needs none)."""
        return None

    def propose(self, batch: Sequence[DraftInput]) -> list[Proposal]:
        """Propose at most ``k`` tokens that follow ``ids``, for every request of ``batch``.

        Sampling (``params.temperature > 0``) proposers that draw at random must draw with the
        request's own generator and return the distributions they drew from in ``probs``.
        """
        raise NotImplementedError

    def propose_free(self, batch: Sequence[DraftInput]) -> list[Proposal]:
        """What it drafts at no model cost, for requests whose step budget asks no paid drafting
        (only if ``free_drafts``): lookups, empty where nothing matches. Adaptive k then verifies
        them only where their calibrated confidences pay (a long verbatim copy)."""
        raise NotImplementedError

    def observe(self, state: Any, feature: torch.Tensor) -> None:
        """The target's feature at the request's last verified position (only if ``uses_features``)."""
        raise NotImplementedError


class PerRequestProposer(Proposer):
    """Base for proposers that draft each request on its own (n-gram lookup, a draft LM)."""

    def propose(self, batch: Sequence[DraftInput]) -> list[Proposal]:
        return [self.propose_one(d) for d in batch]

    def propose_one(self, d: DraftInput) -> Proposal:
        raise NotImplementedError


class ModelSlot:
    """The serving model and its version, and one replacement waiting to be taken."""

    def __init__(self, model, version: str) -> None:
        self.model, self.version = model, version
        self._incoming: tuple[object, str] | None = None
        self._lock = threading.Lock()

    def offer(self, model, version: str) -> None:
        """Hand over a new model (from any thread); the newest offer wins."""
        with self._lock:
            self._incoming = (model, version)

    def take(self) -> bool:
        """Serve the offered model from now on (the engine calls this between steps)."""
        with self._lock:
            incoming, self._incoming = self._incoming, None
        if incoming is None:
            return False
        self.model, self.version = incoming
        return True


class SwappableDraft(Proposer):
    """A proposer whose model the online learner replaces while it serves (draft LM, head)."""

    swappable = True
    slot: ModelSlot

    @property
    def model(self):
        """The serving model (the online learner copies it and offers the trained copy back)."""
        return self.slot.model

    @property
    def version(self) -> str:
        return self.slot.version

    @version.setter
    def version(self, value: str) -> None:
        self.slot.version = value

    def swap_model(self, model, version: str) -> None:
        """Hand over a new draft; safe from another thread, served from the next step on."""
        self.slot.offer(model, version)

    def take_swap(self) -> bool:
        """Serve the model handed over last, if any (the engine calls this between steps)."""
        return self.slot.take()

    def memory_objects(self) -> list:
        """What this proposer holds in memory, for the memory budget (:mod:`onlinespec.memory`):
        the serving model; a proposer that serves a copy of it adds the copy."""
        return [self.slot.model]
