"""Draft registry: versions round-trip, roll back, and survive SIGKILL in the middle of a publish."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from onlinespec.online.registry import DraftRegistry


def weights(value: float) -> dict:
    return {"layer.weight": torch.full((4, 4), value), "head.bias": torch.full((4,), value)}


def test_publish_load_and_roll_back(tmp_path):
    registry = DraftRegistry(tmp_path)
    v1 = registry.publish(weights(1.0), {"parent": None, "records_seen": 0})
    v2 = registry.publish(weights(2.0), {"parent": v1, "records_seen": 120, "loss": 0.8, "alpha_before": 0.3, "alpha_after": 0.4})
    assert registry.versions() == ["v0001", "v0002"] and registry.current() == v2
    assert torch.equal(registry.load()["layer.weight"], torch.full((4, 4), 2.0))
    assert registry.meta(v2)["alpha_after"] == 0.4
    assert registry.rollback() == v1
    assert torch.equal(registry.load()["head.bias"], torch.full((4,), 1.0))
    with pytest.raises(ValueError, match="no parent"):
        registry.rollback()
    with pytest.raises(FileNotFoundError, match="v0009"):
        registry.set_current("v0009")


def test_tied_tensors_are_saved_once(tmp_path):
    shared = torch.ones(3, 3)
    registry = DraftRegistry(tmp_path)
    registry.publish({"embed.weight": shared, "lm_head.weight": shared}, {})
    assert list(registry.load()) == ["embed.weight"]


PUBLISHER = """
import sys, torch
from onlinespec.online.registry import DraftRegistry
registry = DraftRegistry(sys.argv[1])
i = 0
while True:
    i += 1
    registry.publish({"w": torch.full((512, 1024), float(i))}, {"parent": registry.current()})
    if i == 1:
        print("published", flush=True)
"""


def test_sigkill_during_publish_leaves_every_version_loadable(tmp_path):
    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "published"
        time.sleep(0.05 + 0.07 * attempt)  # then kill it somewhere inside a later publish
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    registry = DraftRegistry(tmp_path)  # cleans up what a kill interrupted
    assert registry.current() in registry.versions()
    for version in registry.versions():
        w = registry.load(version)["w"]
        assert w.shape == (512, 1024) and (w == w[0, 0]).all()
    assert not list(tmp_path.glob(".tmp-*"))
