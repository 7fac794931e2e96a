"""/metrics stays bounded while a draft publishes version after version: the spec-decode series
of a draft's older versions go (a soak published dozens in 30 minutes)."""

from onlinespec.decoding.request import RequestStats
from onlinespec.serve.metrics import KEEP_VERSIONS, ServeMetrics


def test_spec_decode_series_of_old_versions_leave_metrics():
    metrics = ServeMetrics()
    stats = RequestStats(new_tokens=5, prompt_tokens=3, finish_reason="length", seconds=0.1, queued_seconds=0.0,
                            first_token_seconds=0.01, timings=[])
    figures = {"num_drafts": 2, "num_draft_tokens": 4, "num_accepted_tokens": 3, "num_accepted_tokens_per_pos": [2, 1]}
    sizes = []
    for i in range(1, 30):
        for domain in ("code", "chat"):
            metrics.request("d", f"v{i:04d}", domain, stats, figures)
        sizes.append(len(metrics.text().splitlines()))
    assert sizes[-1] == sizes[KEEP_VERSIONS]  # flat once the first versions have gone
    text = metrics.text().decode()
    assert 'version="v0029"' in text and 'version="v0028"' in text and 'version="v0027"' not in text
