"""The replay buffer Q of one draft: bounded, with a retention policy, persisted record by record.

``add`` writes the record to its own safetensors file (temp file, fsync, rename) before it
returns True: an acknowledged record survives a crash or SIGKILL, and a half-written file is
never mistaken for a record. Evicted records' files are deleted.

Retention policies (the paper leaves eviction open):
- ``"clear"``: keep everything (up to the bounds, oldest out first) and empty the buffer after
  each draft update, as in the paper;
- ``"window"``: a sliding window over the most recent records;
- ``"reservoir"``: a uniform sample of every record ever offered (reservoir sampling);
- ``"priority"``: keep the records the current draft does worst on (highest loss, set with
  :meth:`ReplayBuffer.set_priorities`); a new record is assumed hard until scored.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from onlinespec.distill.records import DistillRecord

POLICIES = ("clear", "window", "reservoir", "priority")


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
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown buffer policy {policy!r}: use one of {POLICIES}")
        if max_records < 1 or max_bytes < 1:
            raise ValueError("max_records and max_bytes must be positive")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.policy, self.max_records, self.max_bytes = policy, max_records, max_bytes
        self._rng = random.Random(seed)
        self._entries: list[_Entry] = []
        self._offered = 0  # records ever offered (reservoir sampling needs it)
        self._load()

    # ---- public -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)

    def records(self) -> list[DistillRecord]:
        return [e.record for e in self._entries]

    def add(self, record: DistillRecord) -> bool:
        """Offer a record; True once it is stored durably, False if the policy turned it away."""
        self._offered += 1
        if self.policy == "reservoir" and len(self._entries) >= self.max_records:
            slot = self._rng.randrange(self._offered)
            if slot >= self.max_records:
                self._save_state()
                return False
            self._remove(self._entries[slot])
        seq = (self._entries[-1].seq + 1) if self._entries else self._next_seq_on_disk()
        entry = _Entry(seq, record, _nbytes(record))
        _atomic_save(record, self.directory / f"{seq:012d}.safetensors")
        self._entries.append(entry)
        self._save_state()
        self._enforce_bounds(keep=entry)
        return entry in self._entries

    def set_priorities(self, losses: list[float]) -> None:
        """The current draft's loss on each record, in :meth:`records` order (policy "priority")."""
        if len(losses) != len(self._entries):
            raise ValueError(f"got {len(losses)} losses for {len(self._entries)} records")
        for entry, loss in zip(self._entries, losses):
            entry.priority = float(loss)

    def sample(self, n: int) -> list[DistillRecord]:
        """n records drawn without replacement (by priority for "priority", else uniformly)."""
        n = min(n, len(self._entries))
        if self.policy != "priority":
            return [e.record for e in self._rng.sample(self._entries, n)]
        ranked = sorted(self._entries, key=lambda e: e.priority, reverse=True)
        return [e.record for e in ranked[:n]]

    def after_update(self, used: list[DistillRecord] | None = None) -> None:
        """Called after each draft update: the "clear" policy drops the records the update used
        (``used``; all when None). Records that arrived while it ran stay for the next one."""
        if self.policy == "clear":
            chosen = None if used is None else {id(r) for r in used}
            for entry in list(self._entries):
                if chosen is None or id(entry.record) in chosen:
                    self._remove(entry)

    # ---- internals ------------------------------------------------------------------------------

    def _enforce_bounds(self, keep: _Entry) -> None:
        while len(self._entries) > self.max_records or (self.nbytes > self.max_bytes and len(self._entries) > 1):
            self._remove(self._victim(keep))

    def _victim(self, keep: _Entry) -> _Entry:
        candidates = [e for e in self._entries if e is not keep] or self._entries
        if self.policy == "priority":
            return min(candidates, key=lambda e: e.priority)
        return candidates[0]  # the oldest

    def _remove(self, entry: _Entry) -> None:
        self._entries.remove(entry)
        (self.directory / f"{entry.seq:012d}.safetensors").unlink(missing_ok=True)

    def _next_seq_on_disk(self) -> int:
        return json.loads(self._state_path.read_text()).get("next_seq", 0) if self._state_path.exists() else 0

    @property
    def _state_path(self) -> Path:
        return self.directory / "state.json"

    def _save_state(self) -> None:
        next_seq = (self._entries[-1].seq + 1) if self._entries else self._next_seq_on_disk()
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"offered": self._offered, "next_seq": next_seq}))
        os.replace(tmp, self._state_path)

    def _load(self) -> None:
        if self._state_path.exists():
            self._offered = json.loads(self._state_path.read_text()).get("offered", 0)
        for path in sorted(self.directory.glob("*.safetensors")):
            record = _load_record(path)
            self._entries.append(_Entry(int(path.stem), record, _nbytes(record)))
        for stale in self.directory.glob("*.tmp"):  # a write a crash interrupted: never acknowledged
            stale.unlink()
        self._offered = max(self._offered, len(self._entries))


def _nbytes(record: DistillRecord) -> int:
    size = 8 * (len(record.token_ids) + len(record.positions)) + record.top_ids.nbytes + record.top_logprobs.nbytes
    return size + (record.features.nbytes + len(record.positions) if record.features is not None else 0)


def _atomic_save(record: DistillRecord, path: Path) -> None:
    tensors = {
        "token_ids": torch.tensor(record.token_ids, dtype=torch.long),
        "positions": torch.tensor(record.positions, dtype=torch.long),
        "top_ids": record.top_ids.contiguous(),
        "top_logprobs": record.top_logprobs.contiguous(),
    }
    if record.features is not None:
        tensors["features"] = record.features.contiguous()
        tensors["rejected"] = torch.tensor(record.rejected, dtype=torch.bool)
    meta = {"prompt_len": str(record.prompt_len), "domain": record.domain, "request_id": record.request_id}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _load_record(path: Path) -> DistillRecord:
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
    return DistillRecord(
        tensors["token_ids"].tolist(),
        tensors["positions"].tolist(),
        tensors["top_ids"],
        tensors["top_logprobs"],
        int(meta["prompt_len"]),
        meta["domain"],
        meta["request_id"],
        tensors.get("features"),
        tensors["rejected"].tolist() if "rejected" in tensors else None,
    )
