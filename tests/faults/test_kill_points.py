"""SIGKILL at seeded points of serving, recording and publishing. After each kill, a restarted
process serves the last published version and holds every acknowledged record exactly once."""

from __future__ import annotations

import random
import re
import signal
from pathlib import Path

import pytest

import onlinespec

# Where a write can be cut: a record (before its temp file, after it, after the rename), a
# publish (after the weights, after the folder is complete, after its rename, after CURRENT),
# serving (after an engine step, after the records but before the answer went out).
POINTS = {"record.start": 8, "record.written": 8, "record.committed": 8, "publish.weights": 5, "publish.folder": 5,
          "publish.renamed": 5, "publish.current": 5, "serve.step": 20, "serve.answer": 8}
CASES = [(point, hit) for point, most in POINTS.items() for hit in sorted(random.Random(point).sample(range(1, most + 1), 3))]


def test_every_kill_point_in_the_code_is_killed_at():
    """What a user relies on: every place the code marks as a write that can be cut (each
    ``kill_point("...")`` in src/) is among the points killed at, each at three hits, so a new
    kill point without a case fails here instead of going untested."""
    source = Path(onlinespec.__file__).parent
    marked = {m for path in source.rglob("*.py") for m in re.findall(r'kill_point\("([^"]+)"\)', path.read_text())}
    assert marked == set(POINTS), f"in the code, not killed at: {sorted(marked - set(POINTS))}; killed at, not in the code: {sorted(set(POINTS) - marked)}"
    assert all(sum(p == point for p, _ in CASES) == 3 for point in POINTS)


@pytest.mark.parametrize(("point", "hit"), CASES, ids=[f"{p}:{h}" for p, h in CASES])
def test_sigkill_loses_nothing_acknowledged(point, hit, run_child, restart, tmp_path):
    out = tmp_path / "run"
    run = run_child(out, n=10, kill_at=f"{point}:{hit}")  # hits count from the first answer on: 5 publishes after it
    assert run.returncode == -signal.SIGKILL, f"the kill point {point}:{hit} was not reached: {run.stderr[-2000:]}"
    assert run.acknowledged, "no record was acknowledged before the kill: the case would prove nothing"
    found = restart(out, run.acknowledged)
    served_before = [a["version"] for a in run.answers if a["version"]]
    if served_before:  # versions only move forward: the restart serves one at least as new as the last served
        assert int(found["current"][1:]) >= int(served_before[-1][1:])
    for folder in (out / "drafts" / "code", out / "buffer" / "code"):  # a kill never leaves a file a restart cannot read
        assert not (folder / "quarantine").exists(), sorted(p.name for p in (folder / "quarantine").iterdir())
