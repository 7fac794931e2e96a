"""The suffix indices of a pool's drafts on disk: each draft's in its folder under ``root``
(``<root>/<draft>/suffix-index.safetensors``; a Ray replica keeps its own,
:func:`replica_suffix_file`). A changed index is saved atomically every ``SAVE_SECONDS``, on a
purge, when its draft leaves memory and at shutdown, and loaded again on restart.

An unreadable file (torn, or not an index) is set aside in the draft's ``quarantine/`` and the
index starts empty; set-aside copies may hold requests, so a purge deletes them and retention
ages them out. A file built with another tokenizer stops start-up instead
(:class:`~onlinespec.decoding.proposers.suffix.IdentityMismatch`): its token ids mean other
words here.

Memory: each index in memory counts against the process's memory budget
(:mod:`onlinespec.memory`, kind ``suffix_index``) from :meth:`SuffixFiles.open` to
:meth:`SuffixFiles.close`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from safetensors import SafetensorError

from onlinespec import memory
from onlinespec.decoding.proposers.suffix import IdentityMismatch, SuffixIndex
from onlinespec.storage import set_aside

log = logging.getLogger("onlinespec.pool")

SAVE_SECONDS = 10.0  # a changed suffix index is saved at most this often (and on purge and shutdown)
SUFFIX_FILE = "suffix-index.safetensors"
SUFFIX_FILES = "suffix-index*.safetensors"  # every copy of a draft's: the server's and each Ray replica's


def replica_suffix_file(replica: str) -> str:
    return f"suffix-index.{replica}.safetensors"


class SuffixFiles:
    """The indices of the drafts in memory, each with its file. Every method may be called from
    any thread (the indices lock themselves)."""

    def __init__(self, root: Path, file: str = SUFFIX_FILE, max_tokens: int = 0, identity: str = "",
                 budget: memory.MemoryBudget | None = None) -> None:
        """``root``: the folder with one folder per draft; ``file``: the name an index is saved as
        there; ``max_tokens``: the most an index keeps; ``identity``: the tokenizer's fingerprint;
        ``budget``: the memory budget the indices count against (None: the process's)."""
        self.root, self.file, self.max_tokens, self.identity = root, file, max_tokens, identity
        self.budget = budget or memory.budget()
        self.indices: dict[str, tuple[SuffixIndex, Path]] = {}
        self._saved_at = 0.0

    def open(self, name: str, index: SuffixIndex) -> None:
        """Keep draft ``name``'s index, filled with what its file saved."""
        index.max_tokens, index.identity = self.max_tokens, self.identity
        path = self.root / name / self.file
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            try:
                index.load(path)
            except IdentityMismatch:
                raise
            except (ValueError, KeyError, SafetensorError) as err:  # a bad file; an I/O error of the moment is raised
                moved = set_aside(path, path.parent / "quarantine")
                log.warning("draft %s: its suffix index could not be read (%s): moved to %s, starting empty", name, err, moved)
        self.indices[name] = (index, path)
        index.memory_name, index.budget = name, self.budget
        self.budget.register(index)
        self.budget.check()

    def close(self, name: str) -> None:
        """Save draft ``name``'s index and let it go (the draft leaves memory)."""
        index, path = self.indices.pop(name, (None, None))
        if index is None:
            return
        self.budget.unregister(index)
        index.budget = None
        try:
            index.save(path)
        except OSError as err:
            log.error("draft %s: its suffix index could not be saved on eviction: %s", name, err)

    def save(self, force: bool = False) -> None:
        """Save every changed index (at most every SAVE_SECONDS unless ``force``, which also
        writes an index that has no file yet)."""
        now = time.monotonic()
        if not force and now - self._saved_at < SAVE_SECONDS:
            return
        self._saved_at = now
        for name, (index, path) in list(self.indices.items()):
            if index.dirty or force and not path.exists():
                try:
                    index.save(path)
                except OSError as err:  # a full disk: serving goes on, the index stays in memory
                    log.error("draft %s: its suffix index could not be saved: %s", name, err)

    def expire(self, retention_seconds: float | None) -> None:
        """Retention (housekeeping): requests older than ``retention_seconds`` leave every index,
        and set-aside copies older than that are deleted."""
        for name, (index, path) in list(self.indices.items()):
            try:
                index.expire(retention_seconds)
                if retention_seconds is not None:
                    delete_set_aside(path.parent, time.time() - retention_seconds)
            except Exception:  # one draft's trouble never stops the others' housekeeping
                log.exception("housekeeping of draft %s's suffix index failed; serving goes on", name)

    def purge(self, request_id: str | None = None, before: float | None = None) -> int:
        """Take a request (or those indexed before ``before``) out of every index, durably before
        this returns (the purge is acknowledged), and delete the set-aside copies; how many went."""
        removed = 0
        for index, path in list(self.indices.values()):
            gone = index.purge(request_id, before)
            if gone:
                index.save(path)
                removed += gone
            delete_set_aside(path.parent)
        return removed


def purge_saved_suffix(root: str | Path, request_id: str | None = None, before: float | None = None,
                       drafts: list[str] | None = None, files: str = SUFFIX_FILES) -> int:
    """Purge the suffix indices saved under ``root`` (all of a stopped server's, for ``onlinespec
    data purge``; a running one's drafts that are not in memory, ``drafts``): the requests leave
    every saved index (``files``: which of a draft's, by pattern; a Ray replica purges its own),
    and set-aside (unreadable) copies are deleted; how many indexed requests went."""
    removed = 0
    root = Path(root)
    folders = sorted(root.glob("*")) if drafts is None else [root / name for name in drafts]
    for path in sorted(f for folder in folders for f in folder.glob(files)):
        index = SuffixIndex(max_tokens=2**62)
        try:
            index.load(path)
        except (ValueError, KeyError, SafetensorError):  # unreadable: nothing to keep of it
            path.unlink()
            continue
        gone = index.purge(request_id, before)
        if gone:
            index.save(path)
            removed += gone
    for folder in folders:
        delete_set_aside(folder)
    return removed


def delete_set_aside(folder: Path, before: float | None = None) -> None:
    """Delete the unreadable suffix indices set aside in a draft's folder (they may hold
    requests): all of them, or those last written before ``before``."""
    for stale in (folder / "quarantine").glob(f"{SUFFIX_FILES}.*"):
        if before is None or stale.stat().st_mtime < before:
            stale.unlink(missing_ok=True)
