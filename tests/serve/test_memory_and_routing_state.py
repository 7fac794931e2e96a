"""Issue 46, on a real `onlinespec serve` process: /metrics shows the memory budget (the flag's
value), the bytes held and the evictions by fixed kinds; and a corrupt routing.json in the
out-dir no longer stops start-up: it is set aside in quarantine/, bytes intact, an event says
where, and the server routes afresh."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import start_server

GARBAGE = b'{"router": {"clusters": [1, 2\x00\xff not json'


@pytest.fixture(scope="module")
def corrupt_served(tiny_target_folder, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("memory") / "run"
    out_dir.mkdir()
    (out_dir / "routing.json").write_bytes(GARBAGE)
    process = start_server(tiny_target_folder, out_dir, "--router", "content", "--memory-budget", "64MiB")
    process.out_dir = out_dir
    yield process
    process.stop()


def test_a_corrupt_routing_state_is_quarantined_and_the_server_serves(corrupt_served):
    client = openai.OpenAI(base_url=corrupt_served.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    answer = client.completions.create(model=model, prompt="the cat sat on", max_tokens=4, temperature=0)
    assert answer.choices[0].text and answer.choices[0].finish_reason == "length"
    moved = list((corrupt_served.out_dir / "quarantine").glob("routing.json.*"))
    assert len(moved) == 1 and moved[0].read_bytes() == GARBAGE
    events = [json.loads(line) for line in (corrupt_served.out_dir / "events.jsonl").read_text().splitlines()]
    said = [e for e in events if e["event"] == "routing_quarantined"]
    assert said and said[0]["to"] == str(moved[0]) and said[0]["moved"].endswith("routing.json")


def test_metrics_show_the_memory_budget_used_bytes_and_evictions_by_kind(corrupt_served):
    text = httpx.get(corrupt_served.url + "/metrics", timeout=30).text
    samples = {(s.name, s.labels.get("kind")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("onlinespec:memory_budget_bytes", None)] == 64 * 2**20
    kinds = {kind for name, kind in samples if name == "onlinespec:memory_used_bytes"}
    assert kinds == {"replay_buffer", "suffix_index", "draft", "prefix_cache"}  # fixed kinds, never a client's name
    assert {kind for name, kind in samples if name == "onlinespec:memory_evictions_total"} == kinds
    assert samples[("onlinespec:memory_used_bytes", "draft")] > 0  # the content router's draft in memory is counted
    assert sum(samples[("onlinespec:memory_used_bytes", k)] for k in kinds) <= 64 * 2**20
