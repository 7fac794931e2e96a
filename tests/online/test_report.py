"""The online run's report: a table, and a plot that compares online and static on the same requests."""

from onlinespec.online.report import write_report
from onlinespec.stream import OnlineConfig, summarize


def _row(i: int, domain: str, alpha: float, probed: bool) -> dict:
    stats = {"acceptance_rate": alpha, "tau": 2.0, "accepted": round(alpha * 40), "judged": 40, "new_tokens": 48,
             "seconds": 1.0 + alpha, "tokens_per_s": 48 / (1.0 + alpha)}
    row = {"i": i, "id": f"q{i}", "domain": domain, "draft": domain, "draft_version": "v0001", **stats,
           "alpha_moving_average": alpha, "learner_busy": False, "record_seconds": 0.002}
    if probed:
        row.update(static=dict(stats, acceptance_rate=alpha - 0.05), target_alone=dict(stats, tokens_per_s=20.0),
                   static_learning_off=dict(stats), identical=True)
    return row


def test_report_of_a_run_compared_on_every_other_request(tmp_path):
    rows = [_row(i, "maths" if i < 30 else "code", 0.6 + 0.01 * (i % 7), probed=i % 2 == 0) for i in range(40)]
    result = summarize(rows, OnlineConfig(compare_every=2))
    path = write_report({"online": result}, tmp_path, "two domains", command="onlinespec online ...")
    text = path.read_text()
    assert "the same 20 requests, three ways" in text and "Greedy output identical on 20/20" in text
    assert "relative to learning paused" in text
    assert (tmp_path / "alpha.png").stat().st_size > 10_000


def test_the_report_says_how_many_updates_were_shifted_the_gate_could_tell_and_fell_back():
    from onlinespec.online.report import update_counts

    updates = [{"draft": "code", "version": "v0002", "decidable": True, "outcome": "published", "phase": "shifted"},
               {"draft": "code", "version": None, "decidable": False, "outcome": "refused"},
               {"draft": "code", "version": None, "decidable": None, "outcome": "floor"},
               {"draft": "chat", "version": "v0002", "outcome": "published"}]  # a draft LM: no paired figures
    assert update_counts(updates) == [
        "draft code: 3 updates (1 shifted), 1 published, 1 of 2 decidable, 1 fell back to the starting draft (the floor)",
        "draft chat: 1 updates, 1 published"]
