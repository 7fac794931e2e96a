"""Hostile and careless clients against a live `onlinespec serve` (127.0.0.1, tiny target: the
mechanics): each hostile request gets a clear error for itself alone, while four good streams
run through all of them and end with the target alone's exact text. The table doubles as the
record of what a client sees (docs/reliability.md, "Hostile clients").

Also: a misspelt opt-out is refused, client strings never become unbounded metrics labels, and
nothing the server writes holds a key or is readable by other users.
"""

from __future__ import annotations

import json
import socket
import stat
import threading
import time

import httpx
import pytest

from onlinespec.decoding.sampling import SamplingParams

from tests.serve.conftest import ADMIN

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hello"}]
GOOD_PROMPTS = ["A long answer:", "Once upon a time", "def main():", "The list: 1, 2,"]
GOOD_TOKENS = 150


def hostile_requests(model: str) -> list[tuple]:
    """(what was tried, path, body (dict, or raw bytes), status, the param or code the error names)."""
    chat = lambda **fields: {"model": model, "messages": USER, **fields}  # noqa: E731
    text = lambda prompt, **fields: {"model": model, "prompt": prompt, "max_tokens": 4, **fields}  # noqa: E731
    nested = b'{"model": "%s", "messages": ' % model.encode() + b"[" * 5000 + b"]" * 5000 + b"}"
    return [
        ("a token id past the vocabulary", COMPLETIONS, text([999_999_999]), 400, "prompt"),
        ("a negative token id", COMPLETIONS, text([5, -1]), 400, "prompt"),
        ("the vocabulary size itself", COMPLETIONS, text([49152]), 400, "prompt"),
        ("a boolean as a token id", COMPLETIONS, text([True]), 422, "prompt"),
        ("a float as a token id", COMPLETIONS, text([1.5]), 422, "prompt"),
        ("a prompt that is an object", COMPLETIONS, text({"ids": [1]}), 422, "prompt"),
        ("a misspelt opt-out: Train", CHAT, chat(Train=False), 400, "Train"),
        ("a misspelt opt-out: trian", CHAT, chat(trian=False), 400, "trian"),
        ("a misspelt max_tokens", CHAT, chat(max_token=3), 400, "max_token"),
        ("a misspelt domain field", CHAT, chat(domian="code"), 400, "domian"),
        ("a misspelt message field", CHAT, chat(messages=[{"role": "user", "Content": "hi"}]), 400, "messages.0.Content"),
        ("repetition_penalty 0", CHAT, chat(repetition_penalty=0), 422, "repetition_penalty"),
        ("min_p above 1", CHAT, chat(min_p=1.5), 422, "min_p"),
        ("vLLM's guided_json of an unknown type", CHAT, chat(guided_json={"type": "nope"}), 400, "guided_json"),
        ("a stop token id past the vocabulary", CHAT, chat(stop_token_ids=[999_999]), 400, "stop_token_ids"),
        ("a logit bias of 500", CHAT, chat(logit_bias={"1": 500}), 422, "logit_bias.1"),
        ("a logit bias keyed by text", CHAT, chat(logit_bias={"hello": 1}), 422, "logit_bias"),
        ("a logit bias keyed by a superscript two", CHAT, chat(logit_bias={"²": 1}), 422, "logit_bias"),  # str.isdigit() says yes, int() no
        ("a logit bias past the vocabulary", CHAT, chat(logit_bias={"999999": 1}), 400, "logit_bias"),
        ("top_logprobs 50", CHAT, chat(logprobs=True, top_logprobs=50), 422, "top_logprobs"),
        ("min_tokens past max_tokens", CHAT, chat(max_tokens=4, min_tokens=9), 400, "min_tokens"),
        ("17 prompts", COMPLETIONS, text(["a"] * 17), 400, "prompt"),
        ("n = 1000", CHAT, chat(n=1000), 400, "n"),
        ("JSON nested 5000 deep", CHAT, nested, 400, "invalid_json"),
        ("invalid UTF-8", CHAT, b'{"model": "\xff\xfe", "messages": []}', 400, "invalid_json"),
        ("an empty body", CHAT, b"", 400, "invalid_json"),
        ("a JSON number", CHAT, b"42", 400, "invalid_json"),
        ("a 2000-character stop string", CHAT, chat(stop="x" * 2000), 400, "stop"),
        ("17 stop strings", CHAT, chat(stop=list("abcdefghijklmnopq")), 400, "stop"),
        ("a seed past 64 bits", CHAT, chat(seed=1 << 70), 422, "seed"),
        ("temperature 1e308", CHAT, chat(temperature=1e308), 422, "temperature"),
        ("top_k -2", CHAT, chat(top_k=-2), 422, "top_k"),
        ("max_tokens 10**30", CHAT, chat(max_tokens=10**30), 400, "context_length_exceeded"),
        ("a 150-character domain", CHAT, chat(domain="d" * 150), 400, "domain"),
        ("a domain with a space", CHAT, chat(domain="my domain"), 400, "domain"),
        ("a domain that is a path", CHAT, chat(domain="../../etc"), 400, "domain"),
        ("a domain with a newline", CHAT, chat(domain="a\nb"), 400, "domain"),
        ("an unknown field in stream_options", CHAT, chat(stream=True, stream_options={"include_usage": True, "x": 1}), 422, "stream_options.x"),
        ("a 10,000-character draft name", CHAT, chat(draft="d" * 10_000), 404, "draft"),
    ]


def _stream(url: str, model: str, prompt: str, out: dict) -> None:
    with httpx.stream("POST", url + COMPLETIONS, timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": GOOD_TOKENS, "temperature": 0, "stream": True}) as r:
        out[prompt] = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                              if line.startswith("data: {") and '"choices": [{' in line)


def slow_body(host: str, port: int, seconds: float) -> bytes:
    """Headers, then the body one byte at a time for ``seconds``, then hang up."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n")
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            sock.sendall(b" ")
            time.sleep(0.05)
    return b""


def dropped_stream(url: str, model: str) -> None:
    """A stream read up to its first token, then dropped."""
    with httpx.stream("POST", url + COMPLETIONS, timeout=60,
                      json={"model": model, "prompt": "Drop me", "max_tokens": 200, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if '"text": "' in line:
                break


def test_hostile_requests_fail_alone_while_good_streams_keep_the_target_alones_text(server, model, alone):
    cases = hostile_requests(model)
    assert len(cases) >= 30
    good: dict = {}
    threads = [threading.Thread(target=_stream, args=(server.url, model, p, good)) for p in GOOD_PROMPTS]
    host, port = server.url.removeprefix("http://").split(":")
    threads += [threading.Thread(target=slow_body, args=(host, int(port), 3.0)), threading.Thread(target=dropped_stream, args=(server.url, model))]
    for thread in threads:
        thread.start()
    seen = []
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, path, body, status, where in cases:
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            response = http.post(path, headers={"content-type": "application/json"}, **kwargs)
            seen.append((name, response.status_code))
            assert response.status_code == status, f"{name}: {response.status_code} {response.text[:300]}"
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], name
            assert where in (error["param"], error["code"]), f"{name}: {error}"
            assert len(error["message"]) < 600, f"{name}: the error echoes the request back ({len(error['message'])} characters)"
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads)
    for prompt in GOOD_PROMPTS:
        assert good[prompt] == alone.generate(prompt, SamplingParams(max_new_tokens=GOOD_TOKENS)).text, prompt


def test_neutral_vllm_extras_pass_and_unknown_fields_are_named_not_dropped(server, model, alone):
    body = {"model": model, "prompt": "Hi", "max_tokens": 5, "temperature": 0, "repetition_penalty": 1.0, "min_p": 0,
            "x_trace": "abc", "priority": 3}  # vLLM's priority is served (docs/serve.md, "Scheduling"), not ignored
    response = httpx.post(server.url + COMPLETIONS, json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"] == "x_trace"
    assert response.json()["choices"][0]["text"] == alone.generate("Hi", SamplingParams(max_new_tokens=5)).text


def test_a_flood_past_the_queue_is_refused_with_retry_after_and_good_requests_still_complete(server, model, alone):
    """100 requests at once against a queue of 64 (8 running): the overflow answers 429 with
    Retry-After; every request that was accepted completes with the target alone's text. The 429
    must appear: to avoid it the engine would have to finish 28 requests while the flood arrives
    (here, 4 floods of 100 in a row: 28 refused each time, none finished during the arrival)."""
    body = {"model": model, "prompt": "Flood", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=100)) as http:
        results: list = [None] * 100

        def send(i: int) -> None:
            results[i] = http.post(COMPLETIONS, json=body)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(100)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= 64, f"{codes.count(429)} refused, {codes.count(200)} served"
    expected = alone.generate("Flood", SamplingParams(max_new_tokens=8)).text
    assert all(r.json()["choices"][0]["text"] == expected for r in results if r.status_code == 200)
    assert all(int(r.headers["retry-after"]) >= 1 for r in results if r.status_code == 429)


def test_domains_are_bounded_in_shape_and_number(launch, tmp_path):
    server = launch(tmp_path / "run", "--max-domains", "3")
    url = server.url + COMPLETIONS
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    url_body = lambda d: {"model": model, "prompt": "Hi", "max_tokens": 2, "domain": d}  # noqa: E731
    codes = [httpx.post(url, json=url_body(f"d{i}"), timeout=30).status_code for i in range(5)]
    assert codes == [200, 200, 400, 400, 400], "'default' and two more make 3"
    refused = httpx.post(url, json=url_body("d9"), timeout=30).json()["error"]
    assert refused["code"] == "too_many_domains" and "--max-domains" in refused["message"]
    assert httpx.post(url, json=url_body("d1"), timeout=30).status_code == 200, "a known domain is still served"
    metrics = httpx.get(server.url + "/metrics").text
    labels = {line.split('domain="')[1].split('"')[0] for line in metrics.splitlines() if 'domain="' in line}
    assert labels <= {"default", "d0", "d1"}, labels


def test_nothing_written_holds_a_key_or_is_readable_by_others(server, model):
    """The server was started with --admin-key on its command line (as tests/serve/conftest.py
    does): the lock file names the command with the key blanked; the out-dir is 0700, every
    file in it 0600."""
    httpx.post(server.url + COMPLETIONS, json={"model": model, "prompt": "Keep me", "max_tokens": 4}, timeout=30).raise_for_status()
    time.sleep(1.0)  # the record is written after the answer
    lock = (server.out_dir / "LOCK").read_text()
    assert ADMIN not in lock and "--admin-key ***" in lock, lock
    assert stat.S_IMODE(server.out_dir.stat().st_mode) == 0o700
    files = [p for p in server.out_dir.rglob("*") if p.is_file()]
    assert len(files) > 3
    loose = {str(p.relative_to(server.out_dir)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files if stat.S_IMODE(p.stat().st_mode) & 0o077}
    assert not loose, loose
    for path in files:
        if path.stat().st_size < 5_000_000:
            assert ADMIN.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("how", ["file", "env"])
def test_keys_come_from_a_file_or_the_environment_and_are_checked(launch, tmp_path, how, monkeypatch):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    extra = ("--api-key-file", str(key)) if how == "file" else ()
    if how == "env":
        monkeypatch.setenv("ONLINESPEC_API_KEY", "s3cret")
    server = launch(tmp_path / "run", *extra)
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert "s3cret" not in (tmp_path / "run" / "LOCK").read_text()


def test_tenants_are_separated_by_api_key(launch, tmp_path):
    """Two API keys in the key file, two tenants: what one tenant's requests taught the suffix
    index drafts only that tenant's requests; the response carries no per-drafter figures."""
    keys = tmp_path / "keys"
    keys.write_text("key-of-a\nkey-of-b\n")
    server = launch(tmp_path / "run", "--api-key-file", str(keys), "--draft", "suffix", "-k", "4")
    question = {"model": httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer key-of-a"}).json()["data"][0]["id"],
                "messages": [{"role": "user", "content": "Explain what a cache is, briefly."}], "max_tokens": 24, "temperature": 0}

    def ask(key: str) -> dict:
        response = httpx.post(server.url + CHAT, json=question, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        response.raise_for_status()
        return response.json()

    first, again, other = ask("key-of-a"), ask("key-of-a"), ask("key-of-b")
    spec = lambda r: r["metrics"]["speculative_decoding"]  # noqa: E731
    assert "by_drafter" not in spec(again)
    assert spec(again)["num_accepted_tokens"] > spec(first)["num_accepted_tokens"], "tenant A is drafted from its own first answer"
    assert spec(other)["num_accepted_tokens"] == spec(first)["num_accepted_tokens"], "tenant B sees nothing of A's answer"
    assert other["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]


def test_a_key_acts_for_its_own_tenants_only_and_errors_name_no_other_tenants_domains(launch, tmp_path):
    """A key given tenants ('KEY T1,T2') picks among them with --tenant-header; naming another's
    is a 403 that names no tenant; without the header each key is its own tenant (not a shared
    'default'): a full server's domain error lists only the caller's own domains."""
    keys = tmp_path / "keys"
    keys.write_text("key-of-a team-a,team-b\nkey-of-b\n")
    server = launch(tmp_path / "run", "--api-key-file", str(keys), "--tenant-header", "X-Tenant", "--max-domains", "3")
    model = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer key-of-b"}).json()["data"][0]["id"]

    def post(key: str, domain: str = "default", tenant: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}", **({"X-Tenant": tenant} if tenant else {})}
        body = {"model": model, "prompt": "Hi", "max_tokens": 1, "domain": domain}
        return httpx.post(server.url + COMPLETIONS, json=body, headers=headers, timeout=60)

    assert post("key-of-a", tenant="team-b").status_code == 200, "one of the key's own tenants"
    for key, claimed in (("key-of-a", "team-c"), ("key-of-b", "team-a"), ("key-of-b", "default")):
        refused = post(key, tenant=claimed)
        assert refused.status_code == 403, f"{key} claimed {claimed}: {refused.status_code} {refused.text[:300]}"
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("X-Tenant", "tenant_not_allowed")
        assert "team-" not in error["message"] and "default" not in error["message"], error["message"]
    assert post("key-of-a", domain="alpha").status_code == 200  # tenant team-a, the key's first
    assert post("key-of-b", domain="beta").status_code == 200  # default, alpha, beta: the server's 3
    seen_by_b = post("key-of-b", domain="gamma").json()["error"]
    assert seen_by_b["code"] == "too_many_domains" and "beta" in seen_by_b["message"] and "alpha" not in seen_by_b["message"]
    seen_by_a = post("key-of-a", domain="delta").json()["error"]
    assert "alpha" in seen_by_a["message"] and "beta" not in seen_by_a["message"]
