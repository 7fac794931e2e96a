"""Versioned drafts on disk: publish, list, load, roll back. Every write is atomic.

Layout under the registry folder::

    v0001/model.safetensors   the draft's weights
    v0001/meta.json           parent, records seen, loss, alpha before/after, time, ...
    CURRENT                   the version being served, e.g. "v0003"

A version folder is written under a temporary name and renamed into place; CURRENT is replaced
with ``os.replace``. A crash at any moment leaves every published version loadable and CURRENT
naming one of them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from onlinespec.weights import unique_tensors


class DraftRegistry:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".tmp-*"):  # a publish a crash interrupted
            shutil.rmtree(stale, ignore_errors=True)

    def versions(self) -> list[str]:
        return sorted(p.name for p in self.directory.glob("v[0-9]*") if (p / "meta.json").exists())

    def current(self) -> str | None:
        pointer = self.directory / "CURRENT"
        return pointer.read_text().strip() if pointer.exists() else None

    def meta(self, version: str) -> dict:
        return json.loads((self._path(version) / "meta.json").read_text())

    def publish(self, state_dict: dict[str, torch.Tensor], meta: dict, make_current: bool = True) -> str:
        """Write a new version (weights + metadata) atomically; return its name."""
        existing = self.versions()
        version = f"v{int(existing[-1][1:]) + 1 if existing else 1:04d}"
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.directory))
        try:
            save_file(unique_tensors(state_dict), str(tmp / "model.safetensors"))
            full_meta = {"version": version, "published_at": time.time(), **meta}
            (tmp / "meta.json").write_text(json.dumps(full_meta, indent=2))
            for name in ("model.safetensors", "meta.json"):
                with open(tmp / name, "rb") as handle:
                    os.fsync(handle.fileno())
            tmp.rename(self.directory / version)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if make_current:
            self.set_current(version)
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
        tmp = self.directory / "CURRENT.tmp"
        tmp.write_text(version)
        os.replace(tmp, self.directory / "CURRENT")

    def rollback(self) -> str:
        """Serve the current version's parent; return it."""
        current = self.current()
        parent = self.meta(current).get("parent") if current else None
        if not parent:
            raise ValueError(f"version {current} has no parent to roll back to")
        self.set_current(parent)
        return parent

    def _path(self, version: str) -> Path:
        path = self.directory / version
        if not (path / "meta.json").exists():
            raise FileNotFoundError(f"no draft version {version!r} in {self.directory}; versions: {self.versions()}")
        return path

