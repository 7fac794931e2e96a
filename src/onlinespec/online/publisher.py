"""What a learning draft serves, and what its registry says it serves (arXiv 2310.07177, section 4.2:
the updated draft replaces the serving one).

A candidate that passed the gate is written to the registry and made CURRENT only if its parent is
still what is served, then handed to the proposer, which takes it between two rounds. A restart
serves the registry's current version; an operator's rollback, here or from another process
(``onlinespec drafts rollback``), serves the version it names.
"""

from __future__ import annotations

import logging
import threading

import torch
from safetensors import SafetensorError

from onlinespec.decoding.proposers.base import SwappableDraft
from onlinespec.online.learnable import learnable
from onlinespec.online.registry import DraftRegistry
from onlinespec.storage import kill_point

log = logging.getLogger("onlinespec.learner")


def load_version(model: torch.nn.Module, registry: DraftRegistry, version: str) -> torch.nn.Module:
    """A private copy of ``model`` (a serving draft) holding ``version``'s weights."""
    copied = learnable(model).copy(model)
    learnable(model).load(copied, registry.load(version), f"the weights of {registry.directory.name} {version}")
    return copied.eval()


class Publisher:
    def __init__(self, proposer: SwappableDraft, registry: DraftRegistry, identity: dict, origin: dict | None = None,
                 keep_versions: int = 0) -> None:
        """Serve the registry's current version, or publish the proposer's draft as the first
        version of an empty registry, with ``origin`` (where its weights came from) in its metadata.
        ``keep_versions``: keep this many newest versions (0: all)."""
        self.proposer, self.registry, self.identity, self.keep_versions = proposer, registry, identity, keep_versions
        self.lock = threading.Lock()  # a publish, and noticing another process's CURRENT
        self.pruned: list[str] = []  # versions deleted by keep_versions
        self.unloadable: str | None = None  # a version another process made CURRENT that would not load
        if self._recover() is None:
            registry.publish(proposer.model.state_dict(), {"parent": None, "records_seen": 0, "note": "starting draft",
                                                           **(origin or {}), "identity": identity})
            proposer.version = registry.current()
        # the newest published draft: the next update starts from it even if the proposer has not
        # taken it yet (it swaps between rounds), so no update's work is ever dropped
        self.latest = (proposer.model, proposer.version)
        self.current = proposer.version  # the version this process last made CURRENT

    def _recover(self) -> str | None:
        """A restart (or a rollback): serve the registry's current version, not the starting
        draft; an unreadable version is quarantined and the newest valid one served."""
        while (current := self.registry.recover()) is not None:
            self.registry.check_identity(self.identity)
            try:
                model = self.load(current)
            except SafetensorError as err:  # its file is unreadable: never serve it (other errors are raised)
                self.registry.quarantine(current, f"{type(err).__name__}: {err}")
                continue
            self.proposer.swap_model(model, current)
            self.proposer.take_swap()  # take it now: nothing is being served yet
            return current
        return None

    def load(self, version: str):
        """A private copy of the serving draft holding ``version``'s weights."""
        return load_version(self.proposer.model, self.registry, version)

    def publish(self, candidate, meta: dict, parent: str) -> str | None:
        """Write the candidate to the registry and make it CURRENT, only if its parent is still
        what is served: None if an operator rolled back meanwhile (here or from another
        process: CURRENT is compared and set under the registry's lock), and the version is
        deleted; their choice stands (:meth:`changed` finds another process's)."""
        if parent != self.current:
            return None
        version = self.registry.publish(candidate.state_dict(), meta, make_current=False)
        with self.lock:
            if parent == self.current and self.registry.compare_and_set(parent, version):
                self.current = version
                kill_point("publish.current")
                return version
        self.registry.discard(version)
        return None

    def hand_over(self, candidate, version: str) -> None:
        """The proposer takes the published ``version`` between two rounds; the next update starts from it."""
        self.latest = (candidate, version)
        self.proposer.swap_model(candidate, version)

    def prune(self) -> None:
        """keep_versions: delete old versions (after the hand-over: a failure here costs disk, not the update)."""
        if self.keep_versions:
            try:
                self.pruned += self.registry.prune(self.keep_versions)
            except OSError as err:
                log.warning("draft %s: old versions not pruned (%s)", self.registry.directory.name, err)

    def serve(self, model, version: str) -> None:
        """Serve ``model``, a published ``version`` (:meth:`load`), from the next step on, and make it CURRENT."""
        with self.lock:
            self.registry.set_current(version)
            self.current = version
        self.proposer.swap_model(model, version)
        self.latest = (model, version)

    def changed(self) -> str | None:
        """The version another process made CURRENT (``onlinespec drafts rollback`` while this one
        serves) if it differs from what this one serves and is not known to fail to load, else
        None. Never waits for a publish in flight (the next call looks again)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            current = self.registry.current()
            if not current or current in (self.current, self.unloadable) or current not in self.registry.versions():
                return None
        except OSError:
            return None
        finally:
            self.lock.release()
        return current
