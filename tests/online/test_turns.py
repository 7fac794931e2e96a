"""The learner computes only in the engine's turns: never beside a step, within the share under
load, freely once the engine stops. Real threads; a fake clock only where a share is counted."""

from __future__ import annotations

import threading
import time

import pytest

from onlinespec.online.turns import EngineTurns


def _learner(turns: EngineTurns, units: int, busy: list, overlaps: list, unit_seconds: float = 0.002) -> threading.Thread:
    def run() -> None:
        turns.take()
        try:
            for _ in range(units):
                busy.append("learn")
                if "serve" in busy[:-1]:
                    overlaps.append(True)
                time.sleep(unit_seconds)
                busy.remove("learn")
                turns.checkpoint()
        finally:
            turns.done()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_learning_and_serving_never_compute_at_once_and_every_unit_runs():
    turns = EngineTurns(share=0.5, slice_seconds=0.01)
    busy, overlaps = [], []
    learner = _learner(turns, 40, busy, overlaps)
    deadline = time.monotonic() + 30
    while learner.is_alive() and time.monotonic() < deadline:
        busy.append("serve")  # a step
        if "learn" in busy[:-1]:
            overlaps.append(True)
        time.sleep(0.003)
        busy.remove("serve")
        turns.served(0.003)
        if turns.due():
            turns.give()
    learner.join(1)
    assert not learner.is_alive() and not overlaps
    assert turns.turns_total >= 2  # the update was cut into several turns


@pytest.mark.parametrize("payable, expected", [(1.0, 0.2), (0.5, 0.1), (0.0, 0.0)])
def test_under_load_the_share_spent_stays_near_the_limit_times_the_headroom(payable, expected):
    """A step at a batch where no draft could pay leaves no room for learning: with half the
    serving time there, half the share; with all of it, none (a compute-bound load)."""
    now = [0.0]
    turns = EngineTurns(share=0.2, slice_seconds=0.05, clock=lambda: now[0])
    waiting = threading.Event()
    turns.on_wanted = waiting.set
    stop = threading.Event()

    def learner() -> None:
        turns.take(stop.is_set)
        while not stop.is_set():
            now[0] += 0.05  # one 50 ms unit
            turns.checkpoint(stop.is_set)
        turns.done()

    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    assert waiting.wait(5)
    for i in range(600):  # 30 s of 50 ms steps on the fake clock
        now[0] += 0.05
        turns.served(0.05, payable=(i % 2 == 0) if payable == 0.5 else bool(payable))
        if turns.due():
            turns.give()
    assert turns.headroom() == pytest.approx(payable, abs=0.02)
    assert turns.spent() == pytest.approx(expected, abs=0.05 if expected else 0.0)
    stop.set()
    turns.close()
    thread.join(5)
    assert not thread.is_alive()


def test_a_closed_engine_lets_a_waiting_learner_finish():
    turns = EngineTurns(share=0.1)
    busy, overlaps = [], []
    learner = _learner(turns, 3, busy, overlaps)
    time.sleep(0.05)
    assert turns.wanted()
    turns.close()  # shutdown: nobody gives turns any more
    learner.join(5)
    assert not learner.is_alive()


def test_a_share_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="learning share"):
        EngineTurns(share=0.0)


def test_a_turn_the_process_was_suspended_in_does_not_count_the_pause_as_learning():
    """SIGSTOP (or a frozen container) mid-turn: the engine's 0.1 s wake-ups stop, the clock goes
    on. Counting the pause as learning would starve the learner under load for minutes after."""
    now = [0.0]
    turns = EngineTurns(share=0.1, slice_seconds=0.05, clock=lambda: now[0])
    waiting, release = threading.Event(), threading.Event()
    turns.on_wanted = waiting.set

    def learner() -> None:
        turns.take()
        now[0] += 0.05  # a unit
        now[0] += 120.0  # the process is stopped for two minutes in the middle of the turn
        release.wait(5)
        turns.done()

    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    assert waiting.wait(5)
    threading.Timer(0.3, release.set).start()
    turns.give()
    thread.join(5)
    assert turns.learn_seconds_total < 1.0


@pytest.mark.parametrize("threads", [1, 2])
def test_an_update_in_the_engines_turns_computes_on_the_learners_threads_not_every_core(threads):
    # a second OpenMP team in the process makes llama.cpp's barriers sleep (onlinespec.online.budget):
    # in its turns the learner keeps LearnerConfig.threads, 1 by default
    import torch

    from onlinespec.online.budget import UpdateBudget
    from onlinespec.online.config import LearnerConfig

    assert LearnerConfig().threads == 1
    turns = EngineTurns(share=1.0)
    budget = UpdateBudget(LearnerConfig(threads=threads), background=True, turns=turns, cancelled=lambda: False)
    seen = []

    def update() -> None:
        budget.enter()
        seen.append(torch.get_num_threads())
        budget.give_turn_back()

    thread = threading.Thread(target=update, daemon=True)
    thread.start()
    while thread.is_alive():
        turns.give()
        thread.join(0.01)
    assert seen == [threads]
