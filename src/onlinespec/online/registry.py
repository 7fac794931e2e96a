"""Versioned drafts on disk: publish, list, load, roll back, prune. Every write is durable and atomic.

Layout under the registry folder::

    v0001/model.safetensors   the draft's weights
    v0001/meta.json           parent, records seen, loss, alpha before/after, time, identity, ...
    CURRENT                   the version being served, e.g. "v0003"
    quarantine/               versions found unreadable on start (never served)

A version folder is written under a temporary name, fsynced, renamed into place and the folder
fsynced; CURRENT is replaced the same way (:mod:`onlinespec.storage`). A crash at any
moment leaves every published version loadable and CURRENT naming one of them. Versions are
numbered, and ordered by number (``v10000`` follows ``v9999``).

On start (:meth:`DraftRegistry.recover`), a version whose files cannot be read is moved to
``quarantine/``, and a CURRENT that is missing, unreadable or names no valid version falls back to
the newest valid version. ``identity`` (the target, the draft spec and the tokenizer) is written
into every version's metadata; :meth:`DraftRegistry.check_identity` refuses to serve another
model's versions.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from onlinespec.storage import atomic_write, file_lock, fsync_dir, kill_point
from onlinespec.weights import unique_tensors

log = logging.getLogger("onlinespec.registry")

_VERSION = re.compile(r"v(\d+)")


class DraftRegistry:
    def __init__(self, directory: str | Path) -> None:
        """Opening a registry changes nothing on disk (a tool may read one a server writes);
        :meth:`recover` cleans up, for the process that serves from it."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.quarantined: list[str] = []

    def versions(self) -> list[str]:
        """Published versions, oldest first (by number)."""
        found = [p.name for p in self.directory.iterdir() if _VERSION.fullmatch(p.name) and (p / "meta.json").exists()]
        return sorted(found, key=lambda name: int(name[1:]))

    def current(self) -> str | None:
        pointer = self.directory / "CURRENT"
        return pointer.read_text().strip() or None if pointer.exists() else None

    def meta(self, version: str) -> dict:
        return json.loads((self._path(version) / "meta.json").read_text())

    def publish(self, state_dict: dict[str, torch.Tensor], meta: dict, make_current: bool = True) -> str:
        """Write a new version (weights + metadata) durably; return its name."""
        existing = self.versions()
        version = f"v{int(existing[-1][1:]) + 1 if existing else 1:04d}"
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.directory))
        try:
            save_file(unique_tensors(state_dict), str(tmp / "model.safetensors"))
            kill_point("publish.weights")
            full_meta = {"version": version, "published_at": time.time(), **meta}
            (tmp / "meta.json").write_text(json.dumps(full_meta, indent=2))
            for name in ("model.safetensors", "meta.json"):
                with open(tmp / name, "rb") as handle:
                    os.fsync(handle.fileno())
            fsync_dir(tmp)
            kill_point("publish.folder")
            tmp.rename(self.directory / version)
            fsync_dir(self.directory)
            kill_point("publish.renamed")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if make_current:
            self.set_current(version)
            kill_point("publish.current")
        return version

    def load(self, version: str | None = None) -> dict[str, torch.Tensor]:
        """The weights of ``version`` (default: the current one)."""
        version = version or self.current()
        if version is None:
            raise FileNotFoundError(f"registry {self.directory} has no published draft yet")
        return load_file(str(self._path(version) / "model.safetensors"))

    def set_current(self, version: str) -> None:
        """Serve ``version`` from now on (also how a rollback is done)."""
        self._path(version)
        with file_lock(self.directory / ".CURRENT.lock"):
            atomic_write(self.directory / "CURRENT", version)

    def compare_and_set(self, expected: str | None, version: str) -> bool:
        """Make ``version`` current only if CURRENT still names ``expected`` (checked and set
        under one lock, so an operator's rollback from another process is never overwritten)."""
        self._path(version)
        with file_lock(self.directory / ".CURRENT.lock"):
            if self.current() != expected:
                return False
            atomic_write(self.directory / "CURRENT", version)
            return True

    def discard(self, version: str) -> None:
        """Delete a version that never became current (a publish another process superseded)."""
        if version != self.current():
            shutil.rmtree(self._path(version), ignore_errors=True)
            fsync_dir(self.directory)

    def rollback(self) -> str:
        """Serve the current version's parent; return it."""
        current = self.current()
        parent = self.meta(current).get("parent") if current else None
        if not parent:
            raise ValueError(f"version {current} has no parent to roll back to")
        self.set_current(parent)
        return parent

    # ---- recovery, identity, pruning ----------------------------------------------------------

    def recover(self) -> str | None:
        """For the process that serves from this registry (it holds the out-dir): delete what a
        crash left of a publish, quarantine unreadable versions and make CURRENT name a valid
        one (the newest, if it named none); return the version to serve (None: nothing
        published yet)."""
        for stale in self.directory.glob(".tmp-*"):  # a publish a crash interrupted
            shutil.rmtree(stale, ignore_errors=True)
        for version in self.versions():
            problem = _problem(self.directory / version)
            if problem:
                self.quarantine(version, problem)
        valid = self.versions()
        try:
            current = self.current()
        except (OSError, UnicodeDecodeError):
            current = None
        if current in valid:
            return current
        if not valid:
            return None
        fallback = valid[-1]
        log.warning("registry %s: CURRENT named %r, which is not a valid version: serving %s, the newest valid one",
                    self.directory, current, fallback)
        self.set_current(fallback)
        return fallback

    def check_identity(self, identity: dict) -> None:
        """Refuse a registry whose current version was trained for another target, draft or
        tokenizer (versions written before identities were stored pass)."""
        current = self.current()
        stored = self.meta(current).get("identity") if current else None
        if not stored:
            return
        differ = {k: (stored.get(k), v) for k, v in identity.items() if k in stored and stored[k] != v}
        if differ:
            said = "; ".join(f"{k}: the registry's is {a!r}, this run's is {b!r}" for k, (a, b) in differ.items())
            raise ValueError(f"the drafts in {self.directory} were trained for another model ({said}): "
                             "give this run another --out-dir, or start it with the same options")

    def prune(self, keep: int) -> list[str]:
        """Delete old versions, keeping the ``keep`` newest, the current one, its parent and the
        first (the starting draft, which the learner's floor serves again, onlinespec.online.floor);
        return the deleted ones."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest versions kept), got {keep}")
        versions = self.versions()
        current = self.current()
        protect = set(versions[-keep:] + versions[:1]) | {current}
        if current:
            protect.add(self.meta(current).get("parent"))
        doomed = [v for v in versions if v not in protect]
        for version in doomed:
            shutil.rmtree(self.directory / version)
        if doomed:
            fsync_dir(self.directory)
        return doomed

    def quarantine(self, version: str, why: str) -> None:
        """Move ``version`` out of the way (it is never served again) and count it."""
        folder = self.directory / "quarantine"
        folder.mkdir(exist_ok=True)
        shutil.move(str(self.directory / version), folder / f"{version}.{int(time.time() * 1e6)}")
        self.quarantined.append(version)
        log.warning("registry %s: moved version %s to quarantine/ (%s)", self.directory, version, why)

    def _path(self, version: str) -> Path:
        path = self.directory / version
        if not _VERSION.fullmatch(version or "") or not (path / "meta.json").exists():
            raise FileNotFoundError(f"no draft version {version!r} in {self.directory}; versions: {self.versions()}")
        return path


FORMAT_ERRORS = (SafetensorError, ValueError, KeyError, FileNotFoundError)  # the file is bad, not the moment


def _problem(path: Path) -> str | None:
    """Why the version folder ``path`` cannot be served, or None. Only a bad file is a
    problem; an error of the moment (EIO, too many open files, out of memory) is raised."""
    try:
        json.loads((path / "meta.json").read_text())
        with safe_open(str(path / "model.safetensors"), framework="pt") as handle:  # checks the header covers the file
            if not list(handle.keys()):
                return "no tensors"
    except FORMAT_ERRORS as err:
        return f"{type(err).__name__}: {err}"
    return None
