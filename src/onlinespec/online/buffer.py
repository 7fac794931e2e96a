"""The replay buffer Q of one draft: bounded, with a retention policy, persisted record by record.

``add`` writes the record to its own safetensors file (temp file, fsync, rename, fsync the
folder: :func:`onlinespec.storage.commit`) before it returns True: an acknowledged record
survives a crash or SIGKILL, and a half-written file is never mistaken for a record.

On start the folder is read back. A file that is not a record, or a record that cannot be read
(truncated, corrupt), is moved to ``quarantine/`` and counted: it never blocks the restart and
is never trained on. ``identity`` (the tokenizer's fingerprint) is stored in each record;
records written for another tokenizer make the buffer refuse to open, saying so.

Eviction policies (the paper leaves eviction open):
- ``"clear"``: keep everything (up to the bounds, oldest out first) and empty the buffer after
  each draft update, as in the paper;
- ``"window"``: a sliding window over the most recent records;
- ``"reservoir"``: a uniform sample of every record ever offered (reservoir sampling);
- ``"priority"``: keep the records the serving draft does worst on (the learner scores every
  record after each update, :meth:`ReplayBuffer.set_priorities`); a new record is assumed hard
  until scored.

Governance: ``retention_seconds`` drops records older than that (on start, on every add and on
:meth:`expire`); :meth:`purge` deletes a request's records (or those older than a time) on
demand; ``counts`` says how many were stored, evicted, expired, purged and quarantined.

Memory: the records are held in RAM too (every update trains on the whole buffer), measured by
:func:`onlinespec.memory.object_bytes` (tensors' ``element_size * numel``, lists with their int
objects). Besides its own ``max_bytes``, the buffer counts against the process's memory budget
(:mod:`onlinespec.memory`): past it, the largest buffer gives its oldest records up
(:meth:`shed`), from disk too, each eviction reported (``memory_evicted`` events). Every method
may be called from any thread (one lock).
"""

from __future__ import annotations

import functools
import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from onlinespec import memory
from onlinespec.distill.records import DistillRecord
from onlinespec.online.recorder import STUDENT_MARK
from onlinespec.storage import atomic_write, commit, kill_point, set_aside

log = logging.getLogger("onlinespec.buffer")

POLICIES = ("clear", "window", "reservoir", "priority")


def _locked(method):
    """Run ``method`` under the buffer's lock (the memory budget may shed from any thread)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return run


@dataclass
class _Entry:
    seq: int
    record: DistillRecord
    nbytes: int
    priority: float = float("inf")


class ReplayBuffer:
    def __init__(
        self,
        directory: str | Path,
        policy: str = "window",
        max_records: int = 10_000,
        max_bytes: int = 512 * 2**20,
        seed: int = 0,
        retention_seconds: float | None = None,
        identity: str = "",
        clock: Callable[[], float] | None = None,
        budget: memory.MemoryBudget | None | str = "process",
    ) -> None:
        """``budget``: the memory budget it counts against ("process": the process's,
        :func:`onlinespec.memory.budget`; None: none, for a buffer opened only to purge it)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown buffer policy {policy!r}: use one of {POLICIES}")
        if max_records < 1 or max_bytes < 1:
            raise ValueError(f"max_records and max_bytes must be positive, got {max_records} and {max_bytes}")
        if retention_seconds is not None and not retention_seconds > 0:
            raise ValueError(f"retention must be a positive number of seconds (or none), got {retention_seconds}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.policy, self.max_records, self.max_bytes = policy, max_records, max_bytes
        self.retention_seconds, self.identity = retention_seconds, identity
        self.clock = clock or (lambda: time.time())  # looked up at each call: a test may move the clock
        self._rng = random.Random(seed)
        self._entries: list[_Entry] = []
        self._offered = 0  # records ever offered (reservoir sampling needs it)
        self._next_seq = 0
        self.counts = dict.fromkeys(("stored", "evicted", "expired", "purged", "quarantined"), 0)
        self.memory_kind, self.memory_name = "replay_buffer", self.directory.name
        self._lock = threading.RLock()
        self._bytes = 0  # the records' bytes in RAM (object_bytes), kept as they come and go
        self._load()
        self.expire()
        self.budget = memory.budget() if budget == "process" else budget
        if self.budget is not None:
            self.budget.register(self)
            self.budget.check()

    # ---- public -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def memory_bytes(self) -> int:
        return self._bytes

    @_locked
    def records(self) -> list[DistillRecord]:
        return [e.record for e in self._entries]

    def add(self, record: DistillRecord) -> bool:
        """Offer a record; True once it is stored durably, False if the policy turned it away.
        An ``OSError`` (a full disk) stores nothing and leaves the buffer as it was. The memory
        budget is enforced after (a stored record may then be evicted, and reported)."""
        stored = self._add(record)
        if self.budget is not None:
            self.budget.check()
        return stored

    @_locked
    def shed(self, nbytes: int) -> dict | None:
        """The memory budget's eviction: the oldest records go (from disk too) until ``nbytes``
        are freed or none is left; what went, or None."""
        before, gone = self._bytes, []
        while self._entries and before - self._bytes < nbytes:
            victim = min(self._entries, key=lambda e: e.seq)
            self._remove(victim, "evicted")
            gone.append(victim.record)
        if not gone:
            return None
        self._save_state()
        return {"items": len(gone), "records": len(gone), "oldest_created_at": min(r.created_at for r in gone),
                "newest_created_at": max(r.created_at for r in gone), "held": len(self._entries)}

    @_locked
    def _add(self, record: DistillRecord) -> bool:
        self.expire()
        if self.policy == "reservoir" and len(self._entries) >= self.max_records:
            slot = self._rng.randrange(self._offered + 1)
            if slot >= self.max_records:
                self._offered += 1
                self._save_state()
                return False
            victim = self._entries[slot]
        else:
            victim = None
        entry = _Entry(self._next_seq, record, _nbytes(record))
        _atomic_save(record, self._path(entry.seq), self.identity)
        self._offered += 1
        self._next_seq += 1
        self.counts["stored"] += 1
        self._entries.append(entry)  # durable from here on: nothing below may say otherwise
        self._bytes += entry.nbytes
        if victim is not None:
            self._remove(victim, "evicted")
        self._enforce_bounds(keep=entry)
        try:
            self._save_state()
        except OSError as err:  # advisory: a restart recomputes it from the record files
            log.warning("buffer %s: state.json not updated (%s); the record is stored", self.directory, err)
        return entry in self._entries

    @_locked
    def set_priorities(self, scored: list[tuple[DistillRecord, float]]) -> None:
        """The serving draft's loss on records (policy "priority"); records no longer held are
        skipped, records not scored keep their priority (a new one: infinite, i.e. hard)."""
        by_id = {id(record): loss for record, loss in scored}
        for entry in self._entries:
            if id(entry.record) in by_id:
                entry.priority = float(by_id[id(entry.record)])

    @_locked
    def sample(self, n: int) -> list[DistillRecord]:
        """n records drawn without replacement (by priority for "priority", else uniformly)."""
        n = min(n, len(self._entries))
        if self.policy != "priority":
            return [e.record for e in self._rng.sample(self._entries, n)]
        ranked = sorted(self._entries, key=lambda e: e.priority, reverse=True)
        return [e.record for e in ranked[:n]]

    @_locked
    def after_update(self, used: list[DistillRecord] | None = None) -> None:
        """Called after each draft update: the "clear" policy drops the records the update used
        (``used``; all when None). Records that arrived while it ran stay for the next one."""
        if self.policy == "clear":
            chosen = None if used is None else {id(r) for r in used}
            for entry in list(self._entries):
                if chosen is None or id(entry.record) in chosen:
                    self._remove(entry, "evicted")

    @_locked
    def expire(self) -> int:
        """Drop the records older than the retention period (none without one); how many."""
        if self.retention_seconds is None:
            return 0
        cutoff = self.clock() - self.retention_seconds
        self._clear_quarantine(cutoff)  # unreadable copies expire too
        return self._drop(lambda e: e.record.created_at < cutoff, "expired")

    def _clear_quarantine(self, before: float | None = None) -> None:
        """Delete the quarantined files (all, or those last written before ``before``): being
        unreadable, none can be shown not to hold a purged request's text."""
        quarantine = self.directory / "quarantine"
        for path in quarantine.iterdir() if quarantine.is_dir() else ():
            if path.name != "README.txt" and (before is None or path.stat().st_mtime < before):
                path.unlink(missing_ok=True)

    @_locked
    def purge(self, request_id: str | None = None, before: float | None = None) -> int:
        """Delete the records of request ``request_id`` (its student branches included), or
        those recorded before time ``before``; how many were deleted."""
        if request_id is None and before is None:
            raise ValueError("purge needs a request id or a time")

        def doomed(entry: _Entry) -> bool:
            rid = entry.record.request_id
            return (request_id is not None and (rid == request_id or rid.startswith(request_id + STUDENT_MARK))) or (
                before is not None and entry.record.created_at < before)

        self._clear_quarantine(None if request_id is not None else before)
        return self._drop(doomed, "purged")

    # ---- internals ------------------------------------------------------------------------------

    def _drop(self, doomed: Callable[[_Entry], bool], why: str) -> int:
        victims = [e for e in self._entries if doomed(e)]
        for entry in victims:
            self._remove(entry, why)
        if victims:
            self._save_state()
        return len(victims)

    def _enforce_bounds(self, keep: _Entry) -> None:
        while len(self._entries) > self.max_records or (self._bytes > self.max_bytes and len(self._entries) > 1):
            self._remove(self._victim(keep), "evicted")

    def _victim(self, keep: _Entry) -> _Entry:
        candidates = [e for e in self._entries if e is not keep] or self._entries
        if self.policy == "priority":
            return min(candidates, key=lambda e: e.priority)
        return candidates[0]  # the oldest

    def _path(self, seq: int) -> Path:
        return self.directory / f"{seq:012d}.safetensors"

    def _remove(self, entry: _Entry, why: str) -> None:
        self._entries.remove(entry)
        self._bytes -= entry.nbytes
        self._path(entry.seq).unlink(missing_ok=True)
        self.counts[why] += 1

    @property
    def _state_path(self) -> Path:
        return self.directory / "state.json"

    def _save_state(self) -> None:
        atomic_write(self._state_path, json.dumps({"offered": self._offered, "next_seq": self._next_seq}))

    def _quarantine(self, path: Path, why: str) -> None:
        folder = self.directory / "quarantine"
        set_aside(path, folder)
        (folder / "README.txt").write_text("Files found in the buffer that were not readable records; never trained on.\n")
        self.counts["quarantined"] += 1
        log.warning("buffer %s: moved %s to quarantine/ (%s)", self.directory, path.name, why)

    def _load(self) -> None:
        state = {}
        if self._state_path.exists():
            try:
                state = json.loads(self._state_path.read_text())
            except ValueError as err:
                self._quarantine(self._state_path, f"unreadable state: {err}")
        for path in sorted(self.directory.iterdir()):
            if path.name in ("state.json", "quarantine") or path.is_dir():
                continue
            if path.name.endswith(".tmp"):  # a write a crash interrupted: never acknowledged
                path.unlink()
                continue
            if not _RECORD_NAME.fullmatch(path.name):
                self._quarantine(path, "not a record file")
                continue
            try:
                record, identity = _load_record(path)
            except (SafetensorError, ValueError, KeyError, TypeError) as err:  # truncated, corrupt, missing fields
                self._quarantine(path, f"unreadable record: {type(err).__name__}: {err}")
                continue  # (an error of the moment, EIO or out of memory, is raised: the record may be fine)
            if identity and self.identity and identity != self.identity:
                raise ValueError(f"the replay buffer {self.directory} holds records of another tokenizer ({identity}, this "
                                 f"model's is {self.identity}): give this model another --out-dir")
            self._entries.append(_Entry(int(path.name[:12]), record, _nbytes(record)))
            self._bytes += self._entries[-1].nbytes
        seqs = [e.seq + 1 for e in self._entries]
        self._next_seq = max([int(state.get("next_seq", 0)), *seqs])
        self._offered = max(int(state.get("offered", 0)), len(self._entries))


_RECORD_NAME = re.compile(r"\d{12}\.safetensors")


def _nbytes(record: DistillRecord) -> int:
    """The record's bytes in RAM: its tensors and its lists (with their int objects)."""
    parts = (record.token_ids, record.positions, record.top_ids, record.top_logprobs, record.features, record.rejected)
    return sum(memory.object_bytes(part) for part in parts)


def _atomic_save(record: DistillRecord, path: Path, identity: str = "") -> None:
    tensors = {
        "token_ids": torch.tensor(record.token_ids, dtype=torch.long),
        "positions": torch.tensor(record.positions, dtype=torch.long),
        "top_ids": record.top_ids.contiguous(),
        "top_logprobs": record.top_logprobs.contiguous(),
    }
    if record.features is not None:
        tensors["features"] = record.features.contiguous()
        tensors["rejected"] = torch.tensor(record.rejected, dtype=torch.bool)
    meta = {"prompt_len": str(record.prompt_len), "domain": record.domain, "request_id": record.request_id,
            "created_at": repr(record.created_at), "identity": identity}
    tmp = path.with_name(path.name + ".tmp")
    try:
        kill_point("record.start")
        try:
            save_file(tensors, str(tmp), metadata=meta)
        except SafetensorError as err:  # its I/O errors (a full disk) are OSErrors like any write's
            raise OSError(f"the record could not be written to {tmp}: {err}") from err
        kill_point("record.written")
        commit(tmp, path)
        kill_point("record.committed")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _load_record(path: Path) -> tuple[DistillRecord, str]:
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    record = DistillRecord(
        tensors["token_ids"].tolist(),
        tensors["positions"].tolist(),
        tensors["top_ids"],
        tensors["top_logprobs"],
        int(meta["prompt_len"]),
        meta["domain"],
        meta["request_id"],
        tensors.get("features"),
        tensors["rejected"].tolist() if "rejected" in tensors else None,
        float(meta.get("created_at") or path.stat().st_mtime),
    )
    if len(record.positions) != len(record.top_ids) or (record.positions and max(record.positions) >= len(record.token_ids)):
        raise ValueError("its positions do not match its tokens")
    return record, meta.get("identity", "")
