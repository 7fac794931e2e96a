"""The target's calibration (small-batch kernels, cost curve) is measured once per machine and
read back at the next start; ONLINESPEC_RECALIBRATE=1 measures again; an unreadable cache file
is measured over, never fatal."""

import json

import pytest

import onlinespec.factory as api
from onlinespec.factory import engine_options
from onlinespec.models import LoadedModel


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """The measurement, counted; the cache in a folder of the test's own."""
    monkeypatch.setenv("ONLINESPEC_CACHE", str(tmp_path))
    monkeypatch.delenv(api.RECALIBRATE, raising=False)
    calls = []
    measure = api.measure_cost_curve

    def measured(*args, **kwargs):
        calls.append(kwargs)
        return measure(*args, **kwargs)

    monkeypatch.setattr(api, "measure_cost_curve", measured)
    return calls


def test_a_second_start_reads_the_calibration_instead_of_measuring(counted, tiny_llama, tmp_path, monkeypatch):
    target = LoadedModel(tiny_llama(seed=0), None, "tiny")
    first = engine_options(target, 3, adaptive=True, max_batch=2)
    assert len(counted) == 1 and len(list((tmp_path / "calibration").glob("*.json"))) == 1
    other_weights = LoadedModel(tiny_llama(seed=7), None, "tiny, other weights")  # the same architecture
    second = engine_options(other_weights, 3, adaptive=True, max_batch=2)
    assert len(counted) == 1, "the same architecture, dtype and machine: read back, not measured"
    assert second["cost_curve"].seconds == first["cost_curve"].seconds
    engine_options(target, 3, adaptive=True, max_batch=4)  # another set of batch sizes is another measurement
    assert len(counted) == 2
    narrower = engine_options(target, 2, adaptive=True, max_batch=1)  # a subset of its batch sizes and widths: read back
    assert len(counted) == 2 and narrower["cost_curve"].max_width == 5

    monkeypatch.setenv(api.RECALIBRATE, "1")
    engine_options(target, 3, adaptive=True, max_batch=2)
    assert len(counted) == 3


def test_an_unreadable_cached_calibration_is_measured_again_and_replaced(counted, tiny_llama, tmp_path):
    target = LoadedModel(tiny_llama(seed=0), None, "tiny")
    engine_options(target, 3, adaptive=True)
    [saved] = (tmp_path / "calibration").glob("*.json")
    saved.write_text('{"curve": {"1x64": [0.1, "not a number"')
    options = engine_options(target, 3, adaptive=True)
    assert len(counted) == 2 and options["cost_curve"].max_width == 5
    assert json.loads(saved.read_text())["curve"], "the measurement replaced the unreadable file"


def test_a_curve_measured_while_the_machine_was_busy_is_served_low_and_not_kept():
    """Two measurements that disagree (something else ran during one) give the lower of the two,
    flagged unsteady (calibrate then keeps it out of the cache); two that agree are steady."""
    from onlinespec.decoding.cost_curve import CostCurve

    quiet = {(1, 64): [0.010, 0.015, 0.020]}
    busy = {(1, 64): [0.030, 0.016, 0.090]}
    runs = iter([CostCurve(busy), CostCurve(quiet)])
    curve, steady = api.steady_curve(lambda: next(runs))
    assert not steady and curve.seconds == quiet
    runs = iter([CostCurve(quiet), CostCurve({(1, 64): [0.011, 0.014, 0.021]})])
    curve, steady = api.steady_curve(lambda: next(runs))
    assert steady and curve.seconds == {(1, 64): [0.010, 0.014, 0.020]}
