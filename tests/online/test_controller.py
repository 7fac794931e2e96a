"""Learn when it pays: a draft whose updates stop raising served tokens per forward backs off,
one that gains (or drifts) learns at the full rate, and the engine's share follows."""

from onlinespec.online.controller import ControllerConfig, LearnController


def _serve(controller, draft, version, tau, n=8):
    events = []
    for _ in range(n):
        events += controller.served(draft, version, new_tokens=round(tau * 10), forwards=10)
    return events


def test_updates_that_earn_nothing_back_off_and_a_gain_or_a_drift_brings_the_full_rate_back():
    c = LearnController(0.2, ControllerConfig(window=8, min_gain=0.05, patience=2, max_backoff=8))
    _serve(c, "code", "v1", 1.5)
    assert c.updated("code", "v2", "v1", 1.0) == []  # judged once v2 has served a window
    (gained,) = _serve(c, "code", "v2", 1.8)
    assert gained["earned"] and gained["gain"] == 0.3 and c.backoff("code") == 1
    for version, parent in (("v3", "v2"), ("v4", "v3")):  # no better than its parent, twice: patience spent
        c.updated("code", version, parent, 1.0)
        (decision,) = _serve(c, "code", version, 1.8)
        assert not decision["earned"]
    assert c.backoff("code") == 2 and c.share() == 0.1
    (refused,) = c.updated("code", None, "v4", 1.0)  # a candidate the gate refused earns nothing
    assert refused["backoff"] == 4 and c.share() == 0.05
    _serve(c, "chat", "v1", 1.2)  # another draft at the full rate: the engine's share is the limit again
    assert c.share() == 0.2
    (drift,) = c.drift("code")
    assert drift["backoff"] == 1 and c.backoff("code") == 1


def test_a_first_update_with_nothing_to_compare_against_keeps_the_full_rate():
    c = LearnController(0.1)
    (decision,) = c.updated("maths", "v2", "v1", 0.5)
    assert decision["earned"] and decision["gain"] is None and c.backoff("maths") == 1
