"""The server under load and through its life: a bounded queue (429 with Retry-After), a
per-request timeout, SIGTERM with requests in flight (they finish, exit 0), SIGTERM during an
update (nothing half-published), and a restart that serves the last published version with every
acknowledged record in the buffer."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.registry import DraftRegistry

ADMIN = {"Authorization": "Bearer admin-secret"}


def model_of(server) -> str:
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def long_request(model: str, tokens: int = 200, **extra) -> dict:
    return {"model": model, "prompt": "Go on:", "max_tokens": tokens, "temperature": 0, "ignore_eos": True, **extra}


def events(out_dir) -> list[dict]:
    path = out_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def test_a_full_queue_answers_429_with_retry_after(launch, tmp_path):
    server = launch(tmp_path / "run", "--max-batch", "1", "--max-waiting", "1", "--static")
    model = model_of(server)
    post = lambda i: httpx.post(server.url + "/v1/completions", json=long_request(model), timeout=60)  # noqa: E731
    with ThreadPoolExecutor(6) as pool:
        first = pool.submit(post, 0)
        deadline = time.monotonic() + 30
        while "onlinespec:num_requests_running 1.0" not in httpx.get(server.url + "/metrics").text:  # it holds the one slot
            assert time.monotonic() < deadline
            time.sleep(0.05)
        rest = list(pool.map(post, range(5)))  # while the first runs: one waits, the others are refused
        responses = [first.result(), *rest]
    refused = [r for r in responses if r.status_code == 429]
    assert refused and all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error" for r in refused)
    assert sum(r.status_code == 200 for r in responses) >= 2, [(r.status_code, r.text[:300]) for r in responses]  # the running one and the one that waited
    assert httpx.post(server.url + "/v1/completions", json=long_request(model, 4)).status_code == 200


def test_a_request_past_its_time_limit_fails_and_the_next_is_served(launch, tmp_path):
    server = launch(tmp_path / "run", "--draft", "none", "--request-timeout", "0.05")
    model = model_of(server)
    response = httpx.post(server.url + "/v1/completions", json=long_request(model, 240), timeout=60)
    assert response.status_code == 504 and "limit of 0.05 s" in response.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/completions", json=long_request(model, 1), timeout=60).status_code == 200


def test_sigterm_lets_requests_in_flight_finish_and_exits_0(launch, tmp_path):
    server = launch(tmp_path / "run")
    model = model_of(server)
    started, texts = threading.Barrier(5), {}

    def stream(i: int) -> None:
        chunks = []
        with httpx.stream("POST", server.url + "/v1/completions", json=long_request(model, 150, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    if not chunks:
                        started.wait(30)
                    chunks.append(json.loads(line[6:]))
        texts[i] = chunks

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(30)  # every request is in flight
    server.process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert server.process.wait(60) == 0
    for chunks in texts.values():  # each finished in full, usage and figures included
        final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert final and final[0]["choices"][0]["finish_reason"] == "length"
    assert len(texts) == 4
    assert events(tmp_path / "run")[-1]["event"] == "stop"


def test_sigterm_during_an_update_publishes_nothing_and_a_restart_serves_the_last_version(launch, tmp_path):
    out_dir = tmp_path / "run"
    # run 1: quick updates publish a version or two
    server = launch(out_dir, "--update-interval", "3", "--steps-per-update", "2")
    model = model_of(server)
    acknowledged = set()
    for i in range(7):
        r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": f"a{i}"}, timeout=60,
                       json={"model": model, "prompt": f"def f{i}(x):", "max_tokens": 10, "temperature": 0, "domain": "code"})
        assert r.status_code == 200
        acknowledged.add(f"a{i}")
    while any(d.get("busy") for d in httpx.get(server.url + "/admin/drafts", headers=ADMIN).json()["drafts"]):
        time.sleep(0.05)
    assert server.stop() == 0
    registry = DraftRegistry(out_dir / "drafts" / "code")
    published = registry.current()
    assert published != "v0001"

    # run 2: serves that version; an update that would run for minutes is in flight at SIGTERM
    server = launch(out_dir, "--update-interval", "1000", "--steps-per-update", "100000")
    for i in range(3):
        r = httpx.post(server.url + "/v1/completions", headers={"X-Request-Id": f"b{i}"}, timeout=60,
                       json={"model": model, "prompt": f"def g{i}(x):", "max_tokens": 10, "temperature": 0, "domain": "code"})
        assert r.json()["metrics"]["speculative_decoding"]["draft_version"] == published
        acknowledged.add(f"b{i}")
    assert httpx.post(server.url + "/admin/drafts/code/update", headers=ADMIN).json()["started"]
    deadline = time.monotonic() + 30
    while not any(e["event"] == "update_start" and e["records"] > 7 for e in events(out_dir)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0
    assert registry.current() == published and registry.versions()[-1] == published  # abandoned, unpublished
    stored = {r.request_id for r in ReplayBuffer(out_dir / "buffer" / "code").records()}
    assert acknowledged <= stored

    # run 3: the restart serves the last published version
    server = launch(out_dir)
    drafts = {d["name"]: d for d in httpx.get(server.url + "/admin/drafts", headers=ADMIN).json()["drafts"]}
    assert "code" not in drafts or drafts["code"]["version"] == published
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": model, "prompt": "def h(x):", "max_tokens": 6, "temperature": 0, "domain": "code"})
    assert r.json()["metrics"]["speculative_decoding"]["draft_version"] == published
