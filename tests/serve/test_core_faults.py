"""Faults inside the serving core never stop it: a step that raises fails only its requests, an
update that raises publishes nothing and is counted, and the next requests are served."""

from __future__ import annotations

import time

import pytest

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.online.learner import LearnerConfig
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore
from onlinespec.serve.handles import Failed


@pytest.fixture
def core(tiny_target_folder, tmp_path):
    config = CoreConfig(target=str(tiny_target_folder), draft="target-layers:1", k=2, kernels=False, adaptive_k=False,
                        learner=LearnerConfig(update_interval=2, steps_per_update=2, batch_size=4, priority="normal"))
    core = ServingCore(config, tmp_path / "run")
    core.load()
    yield core
    core.shutdown(drain_seconds=5)


def _break_steps(core, failing: set[int]):
    step, calls = core.engine.step, []

    def broken(active, idle=frozenset()):
        calls.append(len(active))
        if len(calls) in failing:  # mid-request: the batch cache holds this request's rows
            raise RuntimeError("injected fault")
        return step(active, idle)

    core.engine.step = broken
    return step


def test_a_step_that_raises_once_is_recomputed_and_the_request_keeps_its_text(core):
    """Nobody can tell whose fault a failed batched step was: the scheduler drops the cache and
    the request prefills its text again (tests/decoding/test_failure_isolation.py); its answer
    is the one it would have had."""
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    want = core.submit("def f(x):", params).result().text
    step = _break_steps(core, {2})
    try:
        assert core.submit("def f(x):", params).result().text == want
    finally:
        core.engine.step = step


def test_steps_that_raise_twice_in_a_row_fail_their_requests_and_the_next_ones_are_served(core):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    want = core.submit("def f(x):", params).result().text
    failed = core.metrics.registry.get_sample_value("onlinespec:request_failure_total", {"reason": "internal_error"}) or 0
    step = _break_steps(core, {2, 3})
    try:
        with pytest.raises(Failed, match="injected fault"):
            core.submit("def f(x):", params).result()
    finally:
        core.engine.step = step
    assert core.submit("def f(x):", params).result().text == want  # a fresh batch cache, the same answer
    assert core.metrics.registry.get_sample_value("onlinespec:request_failure_total", {"reason": "internal_error"}) == failed + 1


def test_an_update_that_raises_is_counted_and_serving_goes_on(core):
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    core.submit("x =", params, domain="code").result()
    learner = core.pool.drafts["code"].learner

    def broken(*snapshot):
        raise MemoryError("injected: the update ran out of memory")

    learner.updater.run = broken
    core.submit("y =", params, domain="code").result()  # the second request makes the update due
    deadline = time.monotonic() + 30
    while not learner.failures:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    learner.wait()
    assert "MemoryError" in learner.failures[0] and learner.registry.versions() == ["v0001"]
    assert core.metrics.registry.get_sample_value("onlinespec:learner_updates_total", {"draft": "code", "outcome": "failed"}) == 1
    assert core.submit("z =", params, domain="code").result().completion_tokens == 8


def test_housekeeping_that_raises_is_counted_on_metrics_and_goes_on(core):
    tick, calls = core.pool.tick, []

    def flaky():
        calls.append(1)
        if len(calls) <= 2:
            raise OSError("injected: the disk went away for a moment")
        return tick()

    core.pool.tick = flaky
    try:
        deadline = time.monotonic() + 10
        while len(calls) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        core.pool.tick = tick
    assert len(calls) >= 4, "housekeeping stopped after its first failure"
    assert core.metrics.registry.get_sample_value("onlinespec:housekeeping_failures_total") == 2


def test_an_engine_loop_that_stops_fails_what_waits_and_says_so_instead_of_hanging(core):
    """A fault outside a step's own guard (the learning bookkeeping between steps) stops the engine
    loop: the request in flight fails with the cause, the core is no longer ready (/ready: 503), and
    new requests are refused, not left waiting for ever."""
    def broken(seconds, batch):
        raise ZeroDivisionError("injected fault between steps")

    core.share.stepped = broken
    with pytest.raises(Failed, match="injected fault between steps"):
        core.submit("def f(x):", SamplingParams(temperature=0.0, max_new_tokens=8)).result()
    assert not core.ready and "injected fault" in core.error
    with pytest.raises(Exception, match="not ready|failed"):
        core.submit("def f(x):", SamplingParams(temperature=0.0, max_new_tokens=8))
