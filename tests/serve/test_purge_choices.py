"""A purge by the request id a client got back removes every prompt and every choice of that
request: its records in the replay buffer, its suffix-index entries and its event-log lines
(with --log-text they hold its text), as bytes on disk; another request's stay."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from onlinespec.online.buffer import ReplayBuffer
from tests.serve.conftest import ADMIN

PROMPTS = ["Purge alpha zebra quartz one", "Purge beta walrus ochre two"]
KEPT_PROMPT = "Keep gamma heron umber"


def on_disk(out_dir: Path, needle: str) -> list[str]:
    """The files under ``out_dir`` whose bytes hold ``needle`` (the purge's own event line aside)."""
    found = []
    for path in sorted(p for p in out_dir.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if path.suffix == ".jsonl":
            data = b"\n".join(line for line in data.splitlines() if b'"event": "purge"' not in line)
        if needle.encode() in data:
            found.append(str(path.relative_to(out_dir)))
    return found


def wait_for(check, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.2)


def test_a_purge_by_the_returned_id_removes_every_prompt_and_choice_of_the_request(launch, tmp_path):
    out_dir = tmp_path / "run"
    server = launch(out_dir, "--draft", "hybrid", "--log-text")
    http = httpx.Client(base_url=server.url, timeout=120)
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPTS, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 7, "domain": "purgecase"}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    rid = response.headers["x-request-id"]  # the server's own id: the client sent none
    assert len(response.json()["choices"]) == 4
    kept = http.post("/v1/completions", headers={"X-Request-Id": "kept-request"},
                     json={"model": model, "prompt": KEPT_PROMPT, "max_tokens": 8, "temperature": 0, "domain": "purgecase"})
    assert kept.status_code == 200, kept.text

    buffer = out_dir / "buffer" / "purgecase"
    held = lambda: {r.request_id.split("#")[0] for r in ReplayBuffer(buffer).records()}  # noqa: E731
    assert {rid, "kept-request"} <= held(), "each prompt's first choice is recorded, under the returned id"
    wait_for(lambda: any("suffix" in f for f in on_disk(out_dir, rid)), "the suffix index saved with the request")
    lines = (out_dir / "events.jsonl").read_text()
    assert lines.count(f'"id": "{rid}"') == 4 and all(p in lines for p in PROMPTS), "every choice's line, with its text"

    done = admin.post("/admin/data/purge", json={"request_id": rid})
    assert done.status_code == 200, done.text
    assert done.json()["records_deleted"] >= 2 and done.json()["suffix_requests_deleted"] == 2  # one per prompt
    assert on_disk(out_dir, rid) == [], "a record, index entry or log line of the request is still on disk"
    for prompt in PROMPTS:
        assert on_disk(out_dir, prompt) == [], f"the text of {prompt!r} is still on disk"
    assert held() == {"kept-request"}
    assert on_disk(out_dir, "kept-request") and on_disk(out_dir, KEPT_PROMPT), "another request's data stays"
    drafts = admin.get("/admin/drafts").json()["drafts"]
    assert sum(d.get("suffix_index", {}).get("requests", 0) for d in drafts) == 1  # the kept request alone
