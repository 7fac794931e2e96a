"""Bad clients: each kind of bad request gets the right status and OpenAI's error shape, while a
good request served at the same time completes with the target alone's text."""

from __future__ import annotations

import threading

import httpx
import pytest

from onlinespec.decoding.sampling import SamplingParams

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hello"}]
ADMIN = {"Authorization": "Bearer admin-secret"}


def bad_requests(model: str) -> list[tuple]:
    """(name, method, path, body (dict, or raw bytes), headers, status, param or code it must name)."""
    chat = lambda **fields: {"model": model, "messages": USER, **fields}  # noqa: E731
    return [
        ("malformed JSON", "POST", CHAT, b'{"model": ', {}, 400, "invalid_json"),
        ("a JSON list", "POST", CHAT, b"[1, 2]", {}, 400, "invalid_json"),
        ("no model", "POST", CHAT, {"messages": USER}, {}, 422, "model"),
        ("unknown model", "POST", CHAT, chat(model="gpt-9"), {}, 404, "model"),
        ("no messages", "POST", CHAT, {"model": model}, {}, 422, "messages"),
        ("empty messages", "POST", CHAT, chat(messages=[]), {}, 422, "messages"),
        ("bad role", "POST", CHAT, chat(messages=[{"role": "robot", "content": "hi"}]), {}, 422, "messages.0.role"),
        ("content of the wrong type", "POST", CHAT, chat(messages=[{"role": "user", "content": 7}]), {}, 422, "messages.0.content"),
        ("every message empty", "POST", CHAT, chat(messages=[{"role": "user", "content": "  "}]), {}, 400, "messages"),
        ("ends with the assistant", "POST", CHAT, chat(messages=[*USER, {"role": "assistant", "content": "hi"}]), {}, 400, "messages"),
        ("negative temperature", "POST", CHAT, chat(temperature=-0.5), {}, 422, "temperature"),
        ("NaN temperature", "POST", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}' % model.encode(), {}, 422, "temperature"),
        ("temperature as text", "POST", CHAT, chat(temperature="hot"), {}, 422, "temperature"),
        ("top_p 0", "POST", CHAT, chat(top_p=0), {}, 422, "top_p"),
        ("top_p above 1", "POST", CHAT, chat(top_p=1.5), {}, 422, "top_p"),
        ("max_tokens 0", "POST", CHAT, chat(max_tokens=0), {}, 422, "max_tokens"),
        ("max_tokens as text", "POST", CHAT, chat(max_tokens="ten"), {}, 422, "max_tokens"),
        ("a fractional seed", "POST", CHAT, chat(seed=1.5), {}, 422, "seed"),
        ("stream as text", "POST", CHAT, chat(stream="yes"), {}, 422, "stream"),
        ("n = 17", "POST", CHAT, chat(n=17), {}, 400, "n"),
        ("context overflow", "POST", CHAT, chat(max_tokens=100_000), {}, 400, "context_length_exceeded"),
        ("a prompt past the context", "POST", COMPLETIONS, {"model": model, "prompt": "word " * 400}, {}, 400, "context_length_exceeded"),
        ("oversized body", "POST", CHAT, chat(messages=[{"role": "user", "content": "x" * 30_000}]), {}, 413, "body_too_large"),
        ("17 stop strings", "POST", CHAT, chat(stop=list("abcdefghijklmnopq")), {}, 400, "stop"),
        ("presence penalty past 2", "POST", CHAT, chat(presence_penalty=5), {}, 422, "presence_penalty"),
        ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=3), {}, 400, "top_logprobs"),
        ("a tool without a name", "POST", CHAT, chat(tools=[{"type": "function", "function": {}}]), {}, 400, "tools.0"),
        ("stream_options without stream", "POST", CHAT, chat(stream_options={"include_usage": True}), {}, 400, "stream_options"),
        ("an unknown draft", "POST", CHAT, chat(draft="nope"), {}, 404, "draft"),
        ("17 prompts", "POST", COMPLETIONS, {"model": model, "prompt": ["a"] * 17}, {}, 400, "prompt"),
        ("an empty prompt", "POST", COMPLETIONS, {"model": model, "prompt": ""}, {}, 422, "prompt"),
        ("an unknown route", "POST", "/v1/embeddings", {"model": model}, {}, 404, None),
        ("the wrong method", "GET", CHAT, None, {}, 405, None),
        ("admin without a key", "GET", "/admin/drafts", None, {}, 401, "invalid_api_key"),
        ("admin with a wrong key", "POST", "/admin/learning/pause", None, {"Authorization": "Bearer guess"}, 401, "invalid_api_key"),
        ("admin: an unknown draft", "POST", "/admin/drafts/nope/rollback", None, ADMIN, 404, "draft"),
        ("admin: pin without a version body", "POST", "/admin/drafts/nope/pin", b"not json", ADMIN, 400, "version"),
        ("admin: an unknown learning action", "POST", "/admin/learning/explode", None, ADMIN, 404, None),
    ]


def test_every_bad_request_gets_a_clear_error_while_a_good_one_completes(server, model, alone):
    cases = bad_requests(model)
    assert len(cases) >= 20
    good: dict = {}

    def serve_good() -> None:  # streamed, long, in flight through every bad request
        with httpx.stream("POST", server.url + COMPLETIONS, timeout=60,
                          json={"model": model, "prompt": "A long answer:", "max_tokens": 120, "temperature": 0, "stream": True}) as r:
            good["text"] = "".join(__import__("json").loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                                   if line.startswith("data: {") and '"choices": [{' in line)

    thread = threading.Thread(target=serve_good)
    thread.start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, method, path, body, headers, status, where in cases:
            kwargs = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
            response = http.request(method, path, headers={"content-type": "application/json", **headers}, **kwargs)
            assert response.status_code == status, f"{name}: {response.status_code} {response.text[:300]}"
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], name
            if where is not None:
                assert where in (error["param"], error["code"]), f"{name}: {error}"
    thread.join(60)
    assert good["text"] == alone.generate("A long answer:", SamplingParams(max_new_tokens=120)).text
    assert httpx.get(server.url + "/health").json()["status"] == "alive"  # still up


@pytest.mark.parametrize("key", [None, "wrong"])
def test_an_api_key_guards_the_v1_routes(keyed_server, key):
    server = keyed_server
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(server.url + COMPLETIONS, headers=headers, json={"model": "x", "prompt": "a"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    ok = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer right"})
    assert ok.status_code == 200
