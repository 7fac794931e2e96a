"""Durable files, the out-dir lock and kill points: what the buffer, the registry and the core
share so that a crash never corrupts a saved draft or an acknowledged record (docs/reliability.md).

Durability. :func:`commit` makes a fully written temporary file the real one: fsync the file,
``os.replace`` it over the target (atomic on POSIX), fsync the folder so the rename itself
survives a power cut. :func:`atomic_write` writes bytes that way. A reader sees the old file or
the new one, never half of one.

Exclusivity. :class:`OutDirLock` holds ``fcntl.flock`` on ``<out_dir>/LOCK`` for the life of a
serving process. The kernel drops the lock when the process dies (even by SIGKILL), so a stale
lock never blocks a restart; a second process on the same folder gets :class:`OutDirBusy`,
naming the holder.

Kill points. :func:`kill_point` marks a moment of a write (``"record.written"``, ...). The fault
suite (tests/faults) starts a process with ``ONLINESPEC_KILL_AT=name:n``, and the n-th time that
point is reached the process SIGKILLs itself, exactly there. Unset, a kill point is one dict lookup.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from onlinespec.safety import PRIVATE_FILE, private_dir, redacted


def cache_dir() -> Path:
    """Root of everything onlinespec caches (models, data, converted formats, calibrations):
    ``$ONLINESPEC_CACHE`` or ~/.cache/onlinespec."""
    return Path(os.environ.get("ONLINESPEC_CACHE", Path.home() / ".cache" / "onlinespec")).expanduser()

KILL_ENV = "ONLINESPEC_KILL_AT"


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make the entries of ``directory`` (a rename, a new or deleted file) durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Make the complete file ``tmp`` durable as ``path`` (fsync, atomic rename, fsync the folder)."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike[str]):
    """Build a folder beside its final place and rename it into place when the block ends, so a
    crash never leaves half of it; if another process made ``out`` first, theirs is kept. Yields
    the temporary folder (mode 0755); on an error it is removed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        yield tmp
        if out.exists():  # another process won the race: keep theirs
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def set_aside(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> Path:
    """Quarantine: move an unreadable file into ``folder`` (made if need be) as
    ``<name>.<microseconds since the epoch>``, its bytes intact, never overwriting an earlier one;
    where it went. The replay buffer, the suffix indexes and content routing's state share it."""
    path, folder = Path(path), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = int(time.time() * 1e6)
    while (folder / f"{path.name}.{stamp}").exists():
        stamp += 1
    target = folder / f"{path.name}.{stamp}"
    os.replace(path, target)  # the same file system: a rename (the folder sits beside the file)
    return target


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Replace ``path`` with ``data``, durably and atomically (a temp name of its own, so two
    writers never share one)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
        commit(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]):
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the ``with`` block:
    a read-check-write of a small file, across threads and processes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def doomed_events(request_id: str | None = None, before: float | None = None) -> Callable[[bytes], bool]:
    """Whether a line of an event log goes in a purge: it is about request ``request_id`` (every
    choice and prompt of a request carries the id its client got back), it is older than time
    ``before``, or it is not an event (a line a crash cut short)."""

    def doomed(line: bytes) -> bool:
        try:
            event = json.loads(line)
        except ValueError:
            return True
        if not isinstance(event, dict):
            return True
        about = request_id is not None and request_id in (event.get("id"), event.get("request_id"))
        return about or (before is not None and event.get("time", 0) < before)

    return doomed


def copy_kept(source: BinaryIO, target: BinaryIO, doomed: Callable[[bytes], bool], limit: int | None = None) -> int:
    """Copy the lines of ``source`` from where it stands (``limit`` bytes at most) that are not
    ``doomed`` to ``target``; how many lines were left out (a line with no newline, cut short,
    is left out too)."""
    dropped = consumed = 0
    while limit is None or consumed < limit:
        line = source.readline() if limit is None else source.readline(limit - consumed)
        if not line:
            break
        consumed += len(line)
        if line.endswith(b"\n") and not doomed(line):
            target.write(line)
        else:
            dropped += 1
    return dropped


def drop_events(path: str | os.PathLike[str], request_id: str | None = None, before: float | None = None) -> int:
    """Rewrite a JSON-lines event log durably without the lines about request ``request_id``
    (with ``--log-text`` they hold its text) and those older than time ``before`` (a line a
    crash cut short goes too); how many lines went. A file with none to drop is left as it is.
    Nothing may append to ``path`` meanwhile: :meth:`EventLog.drop` purges a log that is open."""
    path = Path(path)
    if not path.exists():
        return 0
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with open(path, "rb") as source, os.fdopen(fd, "wb") as target:
            dropped = copy_kept(source, target, doomed_events(request_id, before))
        if dropped:
            commit(tmp, path)
            return dropped
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    Path(tmp).unlink()
    return 0


def delete_stale_rewrites(path: str | os.PathLike[str]) -> None:
    """Delete the half-written copies of event log ``path`` (and of its rotated files) that a
    purge killed mid-way left beside it: each holds lines of the log, so none may outlive a purge."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.stem}*{path.suffix}.*.tmp"):
        stale.unlink(missing_ok=True)


class EventLog:
    """A process's JSON-lines event log (``events.jsonl``), appended to from any thread. A write
    that fails (a full disk) loses the line, is counted and logged once: the caller goes on.

    Rotation: past ``max_bytes``, or ``max_age`` seconds after the file was started, the log
    becomes ``events.1.jsonl`` (the older ones shift up) and a new one starts; at most ``keep``
    old files are kept, and with ``retention_seconds`` an old file last written before the
    retention cut-off goes. A purge (:meth:`drop`) reaches every file; writers go on meanwhile."""

    def __init__(self, path: str | os.PathLike[str], retention_seconds: float | None = None,
                 max_bytes: int = 64 << 20, max_age: float = 86_400.0, keep: int = 4) -> None:
        """``retention_seconds``: lines older than this go first (on open)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.retention_seconds, self.max_bytes, self.max_age, self.keep = retention_seconds, max_bytes, max_age, keep
        self.failures = 0
        self._lock = threading.Lock()  # every writer's, held briefly
        self._purging = threading.Lock()  # one purge at a time
        self._hold_rotation = False  # a purge is rewriting the files: they stay where they are
        delete_stale_rewrites(self.path)
        if retention_seconds is not None:
            for file in self.files():
                drop_events(file, before=time.time() - retention_seconds)
        self._file = open(self.path, "a")
        self._started = time.time()

    def _rotated(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.{i}{self.path.suffix}")

    def files(self) -> list[Path]:
        """The current log and its rotated predecessors that exist, newest first."""
        return [p for p in (self.path, *map(self._rotated, range(1, self.keep + 1))) if p.exists()]

    def write(self, event: dict) -> dict:
        """Append ``event`` with its time (now, unless it has one); the line written."""
        event = {**event, "time": event.get("time", time.time())}
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.write(json.dumps(event) + "\n")
                    self._file.flush()
                    due = self._file.tell() > self.max_bytes or time.time() - self._started > self.max_age
                    if due and not self._hold_rotation:  # else the first write after the purge rotates
                        self._rotate()
                except OSError as err:
                    self.failures += 1
                    if self.failures == 1:
                        logging.getLogger("onlinespec.serve").error("the event log %s could not be written (%s); serving goes on", self.path, err)
        return event

    def _rotate(self) -> None:
        self._file.close()
        self._rotated(self.keep).unlink(missing_ok=True)
        for i in range(self.keep - 1, 0, -1):
            if self._rotated(i).exists():
                self._rotated(i).rename(self._rotated(i + 1))
        self.path.rename(self._rotated(1))
        if self.retention_seconds is not None:
            cutoff = time.time() - self.retention_seconds
            for old in self.files()[1:]:
                if old.stat().st_mtime < cutoff:
                    old.unlink(missing_ok=True)
        self._file = open(self.path, "a")
        self._started = time.time()

    def drop(self, request_id: str | None = None, before: float | None = None) -> int:
        """:func:`drop_events` on every file of this log while it is open (a purge), without
        holding up the writers: the files are rewritten into new ones beside them while lines go
        on being appended (rotation waits); the lock every writer needs is taken only to copy the
        lines appended meanwhile and swap the new file in (``os.replace``). A crash at any point
        leaves the old file or the new one, whole (the copy left behind goes at the next open)."""
        doomed = doomed_events(request_id, before)
        with self._purging:
            with self._lock:
                if self._file.closed:  # nobody writes: the plain rewrite
                    return sum(drop_events(file, request_id, before) for file in self.files())
                self._file.flush()
                written = os.fstat(self._file.fileno()).st_size  # complete lines: every write holds the lock
                self._hold_rotation = True
            try:
                rotated = [f for f in map(self._rotated, range(1, self.keep + 1)) if f.exists()]  # never written to
                dropped = sum(drop_events(file, request_id, before) for file in rotated)
                return dropped + self._drop_current(doomed, written)
            finally:
                with self._lock:
                    self._hold_rotation = False

    def _drop_current(self, doomed: Callable[[bytes], bool], written: int) -> int:
        """Rewrite the current file without the ``doomed`` lines: its first ``written`` bytes
        without the lock, then, under it, the lines appended since; swap it in if any went."""
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with open(self.path, "rb") as source, os.fdopen(fd, "wb") as target:
                dropped = copy_kept(source, target, doomed, written)
                target.flush()
                os.fsync(target.fileno())  # the bulk reaches the disk before the writers wait
                with self._lock:
                    if not self._file.closed:
                        with contextlib.suppress(OSError):  # a full disk: that line is lost, as in write
                            self._file.flush()
                    dropped += copy_kept(source, target, doomed)  # the lines appended meanwhile
                    if dropped:
                        target.flush()
                        os.fsync(target.fileno())
                        os.replace(tmp, self.path)
                        if not self._file.closed:
                            self._file.close()
                            self._file = open(self.path, "a")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if dropped:
            fsync_dir(self.path.parent)  # the rename survives a power cut before the purge is acknowledged
        else:
            Path(tmp).unlink()
        return dropped

    def close(self) -> None:
        with self._lock:
            try:
                self._file.close()
            except OSError:  # the buffered tail could not be written (a full disk)
                self.failures += 1


class OutDirBusy(RuntimeError):
    """Another live process holds the out-dir."""


class OutDirLock:
    """An exclusive lock on an out-dir, held until :meth:`release` or the process ends."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / "LOCK"
        self._fd: int | None = None

    def acquire(self) -> "OutDirLock":
        private_dir(self.path.parent)  # an out-dir holds users' text: its owner alone reads it
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        os.fchmod(fd, PRIVATE_FILE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutDirBusy(f"{self.path.parent} is in use by another process ({self.holder()}): stop it, or give this "
                             "one another --out-dir; two processes on one folder would overwrite each other's records") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "command": " ".join(redacted(sys.argv))}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._fd = fd
        return self

    def holder(self) -> str:
        """Who holds (or last held) the lock, as the file says."""
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return "holder unknown"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
        return f"pid {info.get('pid')} on {info.get('host')}, since {since}: {info.get('command', '')}"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "OutDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


_PLAN: dict[str, int] = {}
_HITS: dict[str, int] = {}


def arm_kill_points(spec: str) -> None:
    """Replace the kill plan with ``spec`` (as ``ONLINESPEC_KILL_AT`` writes it), hits counted from
    now: the fault suite arms it after a first acknowledged request, so no case is vacuous."""
    _PLAN.clear()
    _HITS.clear()
    for item in filter(None, spec.split(",")):
        name, _, count = item.partition(":")
        _PLAN[name] = int(count or 1)


arm_kill_points(os.environ.get(KILL_ENV, ""))


def kill_point(name: str) -> None:
    """SIGKILL this process here if ``ONLINESPEC_KILL_AT`` names this point (see the module docstring)."""
    if _PLAN and name in _PLAN:
        _HITS[name] = _HITS.get(name, 0) + 1
        if _HITS[name] == _PLAN[name]:
            os.kill(os.getpid(), signal.SIGKILL)
