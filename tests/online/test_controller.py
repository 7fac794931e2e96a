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


def test_a_cold_draft_is_judged_by_the_alpha_it_learnt_not_by_tau():
    """A head born from the target that learns (held-out alpha up 0.08-0.15) while tau barely
    moves (adaptive k hardly drafts with it yet) keeps the full rate; once its published versions
    stop adding alpha, it backs off like any draft."""
    c = LearnController(0.1, ControllerConfig(window=8, patience=2))
    _serve(c, "shared", "v1", 1.04)
    (first,) = c.updated("shared", "v2", "v1", 17.0, alpha_gain=0.15)
    assert first["earned"] and first["measure"] == "alpha" and c.backoff("shared") == 1
    assert _serve(c, "shared", "v2", 1.043) == []  # its tau (+0.003) is not what judges it
    c.updated("shared", None, "v2", 16.0)  # refused once: patience
    (third,) = c.updated("shared", "v3", "v2", 16.0, alpha_gain=0.08)
    assert third["earned"] and c.backoff("shared") == 1
    for version, parent in (("v4", "v3"), ("v5", "v4")):
        (decision,) = c.updated("shared", version, parent, 16.0, alpha_gain=0.002)
        assert not decision["earned"]
    assert c.backoff("shared") == 2
