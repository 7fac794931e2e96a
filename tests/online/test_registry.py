"""Draft registry: versions round-trip, roll back, and survive SIGKILL in the middle of a publish."""

import os
import signal
import time

import forked  # tests/forked.py
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


def test_sigkill_during_publish_leaves_every_version_loadable(tmp_path):
    context = forked.context()  # a process of its own that publishes until killed, forked from the suite's fork server
    for attempt in range(4):
        ready = context.Event()
        publisher = context.Process(target=forked.publish_forever, args=(str(tmp_path), ready), daemon=True)
        publisher.start()
        assert ready.wait(60), "the publisher never published"
        time.sleep(0.05 + 0.07 * attempt)  # then kill it somewhere inside a later publish
        os.kill(publisher.pid, signal.SIGKILL)
        publisher.join()
    registry = DraftRegistry(tmp_path)
    registry.recover()  # cleans up what a kill interrupted
    assert registry.current() in registry.versions()
    for version in registry.versions():
        w = registry.load(version)["w"]
        assert w.shape == (512, 1024) and (w == w[0, 0]).all()
    assert not list(tmp_path.glob(".tmp-*"))


def test_versions_are_ordered_by_number_past_v9999(tmp_path):
    registry = DraftRegistry(tmp_path)
    for number in (9998, 9999):
        (tmp_path / f"v{number}").mkdir()
        (tmp_path / f"v{number}" / "meta.json").write_text("{}")
    (tmp_path / "vnotes").mkdir()  # a folder that is not a version
    version = registry.publish(weights(1.0), {"parent": "v9999"})
    assert version == "v10000" and registry.versions() == ["v9998", "v9999", "v10000"]
    assert registry.publish(weights(2.0), {"parent": version}) == "v10001"


def test_recovery_quarantines_unreadable_versions_and_falls_back_to_the_newest_valid(tmp_path):
    registry = DraftRegistry(tmp_path)
    for value in (1.0, 2.0, 3.0):
        registry.publish(weights(value), {"parent": registry.current()})
    model = tmp_path / "v0003" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-10])  # truncated
    (tmp_path / "v0002" / "meta.json").write_text("{half")
    reopened = DraftRegistry(tmp_path)
    assert reopened.recover() == "v0001" and reopened.current() == "v0001"
    assert reopened.versions() == ["v0001"] and sorted(reopened.quarantined) == ["v0002", "v0003"]
    assert torch.equal(reopened.load()["layer.weight"], torch.full((4, 4), 1.0))
    (tmp_path / "CURRENT").write_text("garbage")
    assert DraftRegistry(tmp_path).recover() == "v0001"
    (tmp_path / "CURRENT").unlink()
    assert DraftRegistry(tmp_path).recover() == "v0001"


def test_prune_keeps_the_newest_the_current_one_its_parent_and_the_starting_draft(tmp_path):
    registry = DraftRegistry(tmp_path)
    for value in range(6):
        registry.publish(weights(float(value)), {"parent": registry.current()})
    registry.set_current("v0003")  # an operator rolled back
    assert registry.prune(keep=2) == ["v0004"]
    assert registry.versions() == ["v0001", "v0002", "v0003", "v0005", "v0006"]
    with pytest.raises(ValueError, match="keep"):
        registry.prune(keep=0)


def test_another_models_registry_is_refused(tmp_path):
    registry = DraftRegistry(tmp_path)
    registry.publish(weights(1.0), {"parent": None, "identity": {"draft": "hybrid", "tokenizer": "49152-aa"}})
    registry.check_identity({"draft": "hybrid", "tokenizer": "49152-aa"})
    with pytest.raises(ValueError, match="draft: the registry's is 'hybrid', this run's is 'target-layers:2'"):
        registry.check_identity({"draft": "target-layers:2", "tokenizer": "49152-aa"})
