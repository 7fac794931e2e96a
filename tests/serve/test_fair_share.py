"""Fair share and bounded cost against a live `onlinespec serve` (127.0.0.1, tiny target; issue 46):
a tenant's short request is not queued behind another tenant's 16-choice floods, which are still
served (and capped by its own queued-token limit); refused requests take no domain slot; /metrics
is behind the key on a keyed server; a trickled body gets 408. The abuse benchmark
(bench/abuse.py) measures the latencies; these tests assert what a client sees."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.serve.admission import MAX_PROMPT_LOGPROB_ENTRIES, admit_budget
from onlinespec.serve.handles import ServeError
from tests.serve.conftest import ADMIN, start_server

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
A, B = {"Authorization": "Bearer key-of-a"}, {"Authorization": "Bearer key-of-b"}
CONTEXT = 96  # --max-model-len: each of B's choices without max_tokens runs to 95 new tokens


@pytest.fixture(scope="module")
def fair(tiny_target_folder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fair")
    (folder / "keys").write_text("key-of-a\nkey-of-b\n")
    process = start_server(tiny_target_folder, folder / "run", "--api-key-file", str(folder / "keys"), "--max-batch", "4",
                           "--max-model-len", str(CONTEXT), "--tenant-max-queued-tokens", "1800", "--max-domains", "2",
                           "--body-timeout", "2")
    process.model = httpx.get(process.url + "/v1/models", headers=A).json()["data"][0]["id"]
    yield process
    process.stop()


class Flood(threading.Thread):
    """One of tenant B's streamed requests: 16 choices, ignore_eos, no max_tokens."""

    def __init__(self, server) -> None:
        super().__init__(daemon=True)
        self.server, self.submitted, self.status, self.finished = server, threading.Event(), None, []
        self.done, self.texts = threading.Event(), [""] * 16

    def run(self) -> None:
        body = {"model": self.server.model, "prompt": "a", "n": 16, "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", self.server.url + COMPLETIONS, json=body, headers=B, timeout=300) as response:
                self.status = response.status_code
                self.submitted.set()
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        for choice in chunk.get("choices", []):
                            self.texts[choice["index"]] += choice.get("text") or ""
                            self.finished += [choice["finish_reason"]] if choice.get("finish_reason") else []
        finally:
            self.submitted.set()
            self.done.set()


def test_refused_requests_take_no_domain_slot(fair):
    """--max-domains 2 ('default' and one more): a request refused for its prompt (past the
    context) or its budget leaves the slot free for the next one."""
    too_long = {"model": fair.model, "prompt": "word " * 200, "max_tokens": 4, "domain": "refused-one"}
    assert httpx.post(fair.url + COMPLETIONS, json=too_long, headers=A, timeout=60).status_code == 400
    past_budget = {"model": fair.model, "prompt": "Hi", "max_tokens": 500, "domain": "refused-two"}
    assert httpx.post(fair.url + COMPLETIONS, json=past_budget, headers=A, timeout=60).status_code == 400
    served = httpx.post(fair.url + COMPLETIONS, json={"model": fair.model, "prompt": "Hi", "max_tokens": 2, "domain": "kept"},
                        headers=A, timeout=60)
    assert served.status_code == 200, served.text
    refused = httpx.post(fair.url + COMPLETIONS, json={"model": fair.model, "prompt": "Hi", "max_tokens": 2, "domain": "other"},
                         headers=B, timeout=60).json()["error"]
    assert refused["code"] == "too_many_domains" and "kept" not in refused["message"], "B never sees A's domain names"


def test_metrics_are_behind_the_admin_key_on_a_keyed_server(fair):
    assert httpx.get(fair.url + "/metrics").status_code == 401
    assert httpx.get(fair.url + "/metrics", headers=B).status_code == 401, "a tenant's key does not read every tenant's labels"
    assert "onlinespec:" in httpx.get(fair.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text


def test_a_short_request_is_not_queued_behind_another_tenants_floods(fair, alone):
    """B sends two 16-choice ignore_eos requests without max_tokens (32 choices on 4 slots); its
    third finds its own queued tokens past --tenant-max-queued-tokens: 429. A's short chat request
    then completes (200, text) before either of B's, and both of B's complete, every choice, with
    the target alone's greedy text (the choice preempted to give A a slot included)."""
    floods = []
    for _ in range(2):
        flood = Flood(fair)
        flood.start()
        assert flood.submitted.wait(120) and flood.status == 200
        floods.append(flood)
    third = httpx.post(fair.url + COMPLETIONS, json={"model": fair.model, "prompt": "a", "n": 16, "ignore_eos": True}, headers=B, timeout=60)
    assert third.status_code == 429 and "--tenant-max-queued-tokens" in third.json()["error"]["message"]
    assert int(third.headers["retry-after"]) >= 1
    chat = {"model": fair.model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}
    answer = httpx.post(fair.url + CHAT, json=chat, headers=A, timeout=300)
    b_done_when_a_answered = [f.done.is_set() for f in floods]
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert b_done_when_a_answered == [False, False], "A waited behind B's work"
    for flood in floods:
        assert flood.done.wait(600)
        assert flood.finished == ["length"] * 16, "B is served too, every choice to its budget"
    texts = {text for flood in floods for text in flood.texts}
    assert len(texts) == 1, "greedy: 32 equal choices, the one preempted to give A a slot included"
    served = texts.pop()
    longer = alone.generate("a", SamplingParams(max_new_tokens=CONTEXT, ignore_eos=True)).text  # the served budget is the context left
    assert served and longer.startswith(served), "the target alone's greedy text"


def test_a_trickled_body_gets_408_and_a_normal_request_still_succeeds(fair):
    with socket.create_connection(("127.0.0.1", fair.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-of-a\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\": ")
        received = b""
        while chunk := sock.recv(65536):  # the server answers and closes: recv returns b"" (a timeout raises)
            received += chunk
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    assert b"body_timeout" in received
    ok = httpx.post(fair.url + COMPLETIONS, json={"model": fair.model, "prompt": "Hi", "max_tokens": 2}, headers=A, timeout=60)
    assert ok.status_code == 200


class _Budget:
    """An engine's budget answer without a model (admit_budget's one question)."""

    def budget(self, prompt_tokens, asked, name="max_new_tokens"):
        return asked or 100


def test_prompt_log_probabilities_past_the_cap_are_a_400_naming_the_field():
    heavy = SamplingParams(max_new_tokens=4, prompt_logprobs=20)
    with pytest.raises(ServeError) as refused:
        admit_budget(_Budget(), heavy, 4096, None, 50_000)
    assert refused.value.status == 400 and refused.value.param == "prompt_logprobs"
    assert str(MAX_PROMPT_LOGPROB_ENTRIES) in refused.value.message
    assert admit_budget(_Budget(), SamplingParams(max_new_tokens=4, prompt_logprobs=5), 4096, None, 50_000) == 4


def test_tenant_weights_parse_and_name_a_malformed_entry():
    from onlinespec.serve.config import tenant_weights

    assert tenant_weights(["team-a=2", " team-b = 0.5 "]) == {"team-a": 2.0, "team-b": 0.5}
    for bad in ("team-a", "team-a=0", "=2", "team-a=x"):
        with pytest.raises(ValueError, match="--tenant-weight"):
            tenant_weights([bad])


def test_serve_flags_reach_the_core_and_the_server(tmp_path, monkeypatch):
    """The flags of issue 46, parsed (nothing starts): 0 is "no cap" for --default-max-tokens and
    --tenant-max-queued-tokens; a malformed --tenant-weight exits 2 naming it."""
    from typer.testing import CliRunner

    from onlinespec import cli
    from onlinespec.serve import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda make_core, host, port, settings, logs: seen.update(core=make_core.args[0], settings=settings))
    monkeypatch.setattr(cli.serving, "private_files", lambda: None)
    args = ["serve", "models/tiny", "--backend", "torch", "--out-dir", str(tmp_path / "run"), "--default-max-tokens", "0",
            "--tenant-max-queued-tokens", "0", "--tenant-max-running", "3", "--tenant-weight", "gold=3", "--body-timeout", "7",
            "--max-connections", "50", "--keep-alive-timeout", "9"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    core, settings = seen["core"], seen["settings"]
    assert (core.default_max_tokens, core.tenant_max_queued_tokens, core.tenant_max_running, core.tenant_weights) == (None, None, 3, {"gold": 3.0})
    assert (settings.body_timeout, settings.max_connections, settings.keep_alive_timeout) == (7.0, 50, 9.0)
    result = CliRunner().invoke(cli.app, [*args, "--tenant-weight", "gold"])
    assert result.exit_code == 2 and "--tenant-weight" in result.output


def test_a_callers_refusals_past_its_rate_wait_and_served_requests_never_do(fair):
    """Issue 46 (the tenant-header flood): a client answered 401 or 403 hundreds of times a second
    took the event loop from every stream. Past a burst of 20, a caller's refusals are held back
    (Retry-After), the answer unchanged; another caller's served request is not."""
    wrong, body = {"Authorization": "Bearer not-a-key"}, {"model": fair.model, "prompt": "Hi", "max_tokens": 1}
    answers = [httpx.post(fair.url + COMPLETIONS, json=body, headers=wrong, timeout=60) for _ in range(50)]
    assert [a.status_code for a in answers] == [401] * 50
    held = ["retry-after" in a.headers for a in answers]  # the bucket refills 5 a second meanwhile
    assert not any(held[:10]) and all(held[-10:]), held
    served = httpx.post(fair.url + COMPLETIONS, json=body, headers=A, timeout=60)
    assert served.status_code == 200 and "retry-after" not in served.headers
