"""The checks a request or an operator's call passes before the core acts (no model): each refusal
is a ServeError that names its field, and an error crosses processes (a Ray replica's) whole. The
HTTP cases here run the real app in this process (httpx's ASGI transport) over a core that is
only a status: what a client or a probe sees before any model work."""

from __future__ import annotations

import asyncio
import pickle
import time
from types import SimpleNamespace

import httpx
import pytest

from onlinespec.serve.admission import Domains, named_draft, queue_full
from onlinespec.serve.app import create_app
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.handles import NotFound, Overloaded, ServeError
from onlinespec.serve.operations import purge_cutoff
from onlinespec.serve.web import ServerSettings


def asgi(core, method: str, path: str, settings: ServerSettings | None = None, **kwargs) -> httpx.Response:
    """One HTTP request to the real app over ``core``, in this process (no lifespan: nothing loads)."""
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(core, settings or ServerSettings()))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(send())


def test_an_error_survives_a_process_boundary_with_its_status_and_fields():
    error = pickle.loads(pickle.dumps(Overloaded("full", retry_after=7)))
    assert type(error) is Overloaded and error.status == 429 and error.retry_after == 7 and error.code == "queue_full"
    error = pickle.loads(pickle.dumps(NotFound("no draft", param="draft")))
    assert type(error) is NotFound and (error.status, error.message, error.param) == (404, "no draft", "draft")


def test_domains_are_labels_and_bounded_in_number():
    domains = Domains(limit=2)
    assert domains.admit("default") == "default" and domains.admit("maths") == "maths"
    with pytest.raises(ServeError) as refused:
        domains.admit("code")
    assert refused.value.code == "too_many_domains" and refused.value.param == "domain"
    assert domains.admit("maths") == "maths"  # a known one is always served
    with pytest.raises(ServeError) as refused:
        domains.admit("not a label")
    assert refused.value.code == "invalid_domain"


def test_a_full_server_names_only_the_callers_own_domains():
    domains = Domains(limit=3)
    domains.admit("secret-project", tenant="team-a")
    domains.admit("maths", tenant="team-b")
    with pytest.raises(ServeError) as refused:
        domains.admit("code", tenant="team-b")
    assert refused.value.code == "too_many_domains" and "maths" in refused.value.message and "default" in refused.value.message
    assert "secret-project" not in refused.value.message, "another tenant's domain name leaked"


def test_health_is_503_while_the_model_loads_and_200_once_it_serves():
    for status, code in (("starting", 503), ("loading", 503), ("calibrating", 503), ("ready", 200), ("draining", 200), ("failed", 500)):
        response = asgi(SimpleNamespace(status=status, error="boom" if status == "failed" else None), "GET", "/health")
        assert response.status_code == code, (status, response.text)


def test_a_content_length_that_is_not_a_number_is_a_400_naming_the_header():
    """'²' passes str.isdigit() and fails int(): it was a 500. (uvicorn's h11 refuses it before the
    app; another ASGI server, or a proxy that passes it, would not.)"""
    response = asgi(SimpleNamespace(status="ready"), "POST", "/v1/completions", content=b"{}",
                    headers={"content-type": "application/json", "content-length": b"\xb2"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "Content-Length" and error["code"] == "invalid_content_length" and "invalid" in error["message"]


def test_an_open_server_trusts_the_tenant_header_and_a_key_picks_only_among_its_own():
    def models(settings: ServerSettings, key: str | None, tenant: str | None) -> httpx.Response:
        headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **({"X-Tenant": tenant} if tenant else {})}
        return asgi(SimpleNamespace(status="ready", started_at=0.0), "GET", "/v1/models", settings, headers=headers)

    open_server = ServerSettings(tenant_header="X-Tenant")
    assert models(open_server, None, "anyone").status_code == 200
    keyed = ServerSettings(api_key="old-style", api_keys=("k-a team-a,team-b",), tenant_header="X-Tenant")
    assert models(keyed, "k-a", "team-b").status_code == 200 and models(keyed, "k-a", None).status_code == 200
    assert models(keyed, "old-style", None).status_code == 200, "a key written alone still works"
    for key, claimed in (("k-a", "team-c"), ("old-style", "team-a"), ("old-style", "default")):
        refused = models(keyed, key, claimed)
        assert refused.status_code == 403, (key, claimed, refused.text)
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("X-Tenant", "tenant_not_allowed")
        assert "team-" not in error["message"] and "default" not in error["message"], error["message"]


def test_a_named_draft_must_exist():
    drafts, baselines = {"maths": object()}, {"none": object()}
    assert named_draft("maths", drafts, baselines) is drafts["maths"]
    assert named_draft("none", drafts, baselines) is baselines["none"]
    with pytest.raises(NotFound) as refused:
        named_draft("code", drafts, baselines)
    assert refused.value.param == "draft"


def test_a_full_queue_says_when_to_retry():
    config = CoreConfig(max_batch=4, max_waiting=8)
    refusal = queue_full(8, config, recent_seconds=2.0)
    assert isinstance(refusal, Overloaded) and refusal.retry_after == 6  # 2 s x (1 + 8 waiting / 4 per batch)
    assert queue_full(8, config, recent_seconds=0.01).retry_after == 1


def test_a_purge_takes_exactly_one_of_a_request_id_and_an_age():
    assert purge_cutoff("req-1", None) is None
    assert abs(purge_cutoff(None, 1) - (time.time() - 86400.0)) < 5
    for request_id, days, code, param in ((None, None, "invalid_purge", None), ("req-1", 1, "invalid_purge", None),
                                          (None, -1, None, "older_than_days")):
        with pytest.raises(ServeError) as refused:
            purge_cutoff(request_id, days)
        assert (refused.value.code, refused.value.param) == (code, param)
