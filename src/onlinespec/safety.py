"""What a client or a command line hands us, made safe: near misses of known field names, labels
with a bounded shape, command lines with their secrets blanked, keys compared in constant time,
and files only their owner can read (docs/reliability.md, "Hostile clients").

Kept below everything that reads user input (the JSONL reader, the HTTP protocol, the serving
core, the lock file), so that each rule lives in one place.
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import os
import re
import shlex
from pathlib import Path
from typing import Iterable

LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")  # a domain, a tenant: what may become a metrics label or a file name
LABEL_RULE = "1-64 characters: letters, digits, '_', '.', ':' or '-', starting with a letter or a digit"
SECRET_OPTIONS = ("--api-key", "--admin-key")  # their values never reach a file, a log or an event
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600


def near_miss(key: str, known: Iterable[str], cutoff: float = 0.75) -> str | None:
    """The known field ``key`` is probably a misspelling of (case, a letter or two), or None.

    A misspelt opt-out (``"Train": false``) must be refused, not ignored: the caller turns a hit
    into an error that names the field meant."""
    known = list(known)
    if key in known:
        return None
    near = difflib.get_close_matches(key.lower(), known, n=1, cutoff=cutoff)
    return near[0] if near else None


def shown(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to about ``limit`` characters: an error may name what a client sent,
    never echo a whole body back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def check_label(value: str, what: str) -> str:
    """``value`` if it has a label's shape, else a ``ValueError`` that says what is allowed."""
    if not isinstance(value, str) or not LABEL.fullmatch(value):
        raise ValueError(f"{what} {shown(value)} is not allowed: give {LABEL_RULE}")
    return value


def redacted(argv: Iterable[str]) -> list[str]:
    """``argv`` with the value of every secret option (``--api-key K`` or ``--api-key=K``) as ``***``."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append("***")
            hide = False
            continue
        name, eq, _ = arg.partition("=")
        if name in SECRET_OPTIONS:
            out.append(f"{name}=***" if eq else arg)
            hide = not eq
        else:
            out.append(arg)
    return out


def command_line(argv: Iterable[str]) -> str:
    """The command a report or a lock file shows: ``onlinespec`` and its arguments, secrets blanked."""
    return shlex.join(["onlinespec", *redacted(argv)])


def same_key(given: str, expected: str) -> bool:
    """Whether two keys are equal, in time that does not depend on where they first differ."""
    return hmac.compare_digest(given.encode(), expected.encode())


def key_tenant(key: str) -> str:
    """The tenant an API key stands for: a name derived from it that does not reveal it."""
    return f"key-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def private_dir(path: str | Path) -> Path:
    """Create ``path`` (and its parents) and make it readable by its owner only."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, PRIVATE_DIR)
    return path


def private_files() -> None:
    """From now on this process creates files 0600 and folders 0700 (a server's records, drafts
    and logs hold users' text): called once by the commands that write an out-dir."""
    os.umask(0o077)
