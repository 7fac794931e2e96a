"""The OpenAI-compatible HTTP API over a :class:`~onlinespec.serve.core.ServingCore` (FastAPI).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``),
``GET /v1/models``, ``GET /health`` (the process is alive), ``GET /ready`` (model loaded and
calibrated), ``GET /metrics`` (Prometheus text), and the admin API under ``/admin`` (Bearer
``--admin-key``): list drafts and versions (with the training data's governance counts), pause / resume learning,
start an update, roll back, purge a request's training records (``POST /admin/data/purge``),
pin a version. Every error has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Handlers never block the event loop: the core's threads push each request's events, and a
wake-up crosses into the loop with ``call_soon_threadsafe``. A client that disconnects, mid-stream
or while waiting, cancels its request; its slot frees at the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from onlinespec.safety import check_label, key_tenant, same_key, shown
from onlinespec.serve.core import ServingCore
from onlinespec.serve.handles import Delta, Handle, NotFound, Overloaded, Served, ServeError
from onlinespec.serve.protocol import ChatRequest, CompletionRequest, parse

POLL_DISCONNECT = 0.5  # seconds between checks that a waiting (non-streaming) client is still there


@dataclass
class ServerSettings:
    model_name: str = "default"  # the `model` clients send
    api_key: str | None = None  # Bearer key for /v1 routes (None: open, unless api_keys)
    api_keys: tuple[str, ...] = ()  # several keys: each is a tenant of its own
    tenant_header: str | None = None  # the tenant is this header's value (else the API key's, else "default")
    admin_key: str | None = None  # Bearer key for /admin routes (None: the admin API is off)
    max_body_bytes: int = 1 << 20
    drain_seconds: float = 30.0  # SIGTERM: how long requests in flight may finish
    load_in_background: bool = True  # answer /health while the model loads


class Unauthorized(ServeError):
    status, kind = 401, "authentication_error"


class Forbidden(ServeError):
    status, kind = 403, "permission_error"


class TooLarge(ServeError):
    status = 413


def error_response(err: ServeError, request_id: str | None = None) -> JSONResponse:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if isinstance(err, Overloaded):
        headers["Retry-After"] = str(err.retry_after)
    body = {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}
    return JSONResponse(body, status_code=err.status, headers=headers)


def create_app(core: ServingCore, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.load_in_background:
            threading.Thread(target=_load_quietly, args=(core,), name="onlinespec-load", daemon=True).start()
        else:
            await asyncio.to_thread(core.load)
        yield
        await asyncio.to_thread(core.shutdown, settings.drain_seconds)

    app = FastAPI(title="onlinespec", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, err: ServeError):
        return error_response(err, request.headers.get("x-request-id"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        kind = NotFound if err.status_code == 404 else ServeError
        error = kind(f"{request.method} {request.url.path}: {err.detail}")
        error.status = err.status_code
        return error_response(error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        error = ServeError(f"internal error: {type(err).__name__}: {err}")
        error.status, error.kind = 500, "internal_error"
        return error_response(error)

    keys = tuple(dict.fromkeys([*([settings.api_key] if settings.api_key else []), *settings.api_keys]))

    def authorize(request: Request, key: str | None, admin: bool = False) -> None:
        if admin and key is None:
            raise Forbidden("the admin API is off: start the server with --admin-key")
        if key is None:
            return
        if not same_key(request.headers.get("authorization", ""), f"Bearer {key}"):
            raise Unauthorized("missing or wrong admin key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")

    def tenant_of(request: Request) -> str:
        """Check the API key; return the request's tenant (docs/serve.md, "Tenants")."""
        given = request.headers.get("authorization", "")
        matched = [key for key in keys if same_key(given, f"Bearer {key}")]  # every key compared: no early exit
        if keys and not matched:
            raise Unauthorized("missing or wrong API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key")
        if settings.tenant_header:
            value = request.headers.get(settings.tenant_header)
            try:
                return check_label(value, f"the {settings.tenant_header} header") if value is not None else "default"
            except ValueError as err:
                raise ServeError(str(err), param=settings.tenant_header, code="invalid_tenant") from None
        return key_tenant(matched[0]) if matched else "default"

    async def body_of(request: Request) -> bytes:
        limit = settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"the body has {declared} bytes: the limit is {limit}", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"the body is over the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    # ---- inference ---------------------------------------------------------------------------

    async def complete(request: Request, chat: bool):
        tenant = tenant_of(request)
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        if len(request_id) > 128 or not request_id.isprintable():
            raise ServeError("X-Request-Id: give at most 128 printable characters", param="X-Request-Id", code="invalid_request_id")
        body = parse(await body_of(request), ChatRequest if chat else CompletionRequest)
        if body.model != settings.model_name:
            raise NotFound(f"model {shown(body.model)} is not served here: use {settings.model_name!r} (GET /v1/models)",
                           param="model", code="model_not_found")
        prompt = body.prompt() if chat else body.text()
        params, max_tokens = body.sampling(), body.limits()
        loop, wake = asyncio.get_running_loop(), asyncio.Event()

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        handle = await asyncio.to_thread(core.submit, prompt, params, body.domain or "default", body.train, body.draft,
                                         request_id, max_tokens, notify, body.stream, tenant)
        shape = Shape(chat, f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", int(time.time()), settings.model_name)
        headers = {"X-Request-Id": request_id}
        ignored = body.ignored_fields()
        if ignored:  # unknown fields that change nothing: said, not silently dropped
            names = (k if k.isascii() and k.isprintable() else ascii(k) for k in ignored)
            headers["X-Ignored-Fields"] = ", ".join(names)[:1000]
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(handle, wake, shape, usage), media_type="text/event-stream", headers=headers)
        try:
            while True:
                for event in drain(handle):
                    if isinstance(event, ServeError):
                        return error_response(event, request_id)
                    if isinstance(event, Served):
                        return JSONResponse(shape.response(event), headers=headers)
                try:
                    await asyncio.wait_for(wake.wait(), POLL_DISCONNECT)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        handle.cancel()
                        return Response(status_code=499)
                wake.clear()
        except asyncio.CancelledError:
            handle.cancel()
            raise

    async def stream(handle: Handle, wake: asyncio.Event, shape: Shape, usage: bool):
        """SSE events: a first chunk with the role, one per verified round, the last with the
        finish reason and the speculation figures, the usage chunk when asked, then [DONE]."""
        try:
            if shape.chat:
                yield sse(shape.chunk(role=True))
            while True:
                wake.clear()
                for event in drain(handle):
                    if isinstance(event, Delta) and event.text:
                        yield sse(shape.chunk(text=event.text))
                    elif isinstance(event, ServeError):
                        yield sse({"error": {"message": event.message, "type": event.kind, "param": event.param, "code": event.code}})
                        yield "data: [DONE]\n\n"
                        return
                    elif isinstance(event, Served):
                        yield sse(shape.chunk(finish=event))
                        if usage:
                            yield sse(shape.usage_chunk(event))
                        yield "data: [DONE]\n\n"
                        return
                await wake.wait()
        finally:
            if not handle.done:  # the client went away (or the server is stopping): free the slot
                handle.cancel()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        tenant_of(request)
        card = {"id": settings.model_name, "object": "model", "created": int(core.started_at), "owned_by": "onlinespec",
                "max_model_len": getattr(core, "context", None)}
        return {"object": "list", "data": [card]}

    # ---- operations --------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if core.status == "failed":
            return JSONResponse({"status": "failed", "error": core.error}, status_code=500)
        return {"status": "alive", "model": core.status}

    @app.get("/ready")
    async def ready():
        if not core.ready:
            return JSONResponse({"status": core.status, "error": core.error}, status_code=503)
        learning = await asyncio.to_thread(core.learning)  # a cluster asks its actors: never on the event loop
        return {"status": "ready", "model": settings.model_name, "draft": core.config.draft, **learning}

    @app.get("/metrics")
    async def metrics():
        text = await asyncio.to_thread(core.metrics.text)  # a cluster gathers its replicas': never on the event loop
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # ---- admin -----------------------------------------------------------------------------------

    async def admin(request: Request, action: str, name: str | None = None, version: str | None = None):
        authorize(request, settings.admin_key, admin=True)
        if not core.ready:
            raise ServeError(f"not ready: the model is {core.status}")
        return await asyncio.to_thread(core.operate, action, name, version)

    @app.get("/admin/drafts")
    async def admin_drafts(request: Request):
        authorize(request, settings.admin_key, admin=True)
        if not core.ready:
            return {"learning": None, "drafts": [], "governance": None, "routing": None, "replicas": []}
        return await asyncio.to_thread(lambda: {"learning": core.learning(), "drafts": core.drafts(), "governance": core.governance(),
                                                "routing": core.routing(), "replicas": core.replica_rows()})

    @app.post("/admin/data/purge")
    async def admin_purge(request: Request):
        authorize(request, settings.admin_key, admin=True)
        if not core.ready:
            raise ServeError(f"not ready: the model is {core.status}")
        try:
            data = json.loads(await body_of(request) or b"{}")
        except ValueError:
            data = None
        shape = "the body must be {\"request_id\": \"ID\"} or {\"older_than_days\": 30}"
        if not isinstance(data, dict) or set(data) - {"request_id", "older_than_days"}:
            raise ServeError(shape)
        rid, days = data.get("request_id"), data.get("older_than_days")
        if not isinstance(rid, (str, type(None))) or isinstance(days, bool) or not isinstance(days, (int, float, type(None))):
            raise ServeError(shape)
        return await asyncio.to_thread(core.purge, rid, days)

    @app.post("/admin/learning/{action}")
    async def admin_learning(request: Request, action: str):
        if action not in ("pause", "resume"):
            raise NotFound(f"unknown learning action {action!r}: use pause or resume")
        return await admin(request, action)

    @app.post("/admin/drafts/{name}/update")
    async def admin_update(request: Request, name: str):
        return await admin(request, "update", name)

    @app.post("/admin/drafts/{name}/rollback")
    async def admin_rollback(request: Request, name: str):
        return await admin(request, "rollback", name)

    @app.post("/admin/drafts/{name}/pin")
    async def admin_pin(request: Request, name: str):
        authorize(request, settings.admin_key, admin=True)
        try:
            data = json.loads(await body_of(request) or b"{}")
        except ValueError:
            data = None
        version = data.get("version") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(version, (str, type(None))):
            raise ServeError("the body must be {\"version\": \"v0003\"} (or {\"version\": null} to unpin)", param="version")
        return await admin(request, "pin", name, version)

    return app


def _load_quietly(core: ServingCore) -> None:
    try:
        core.load()
    except Exception:  # reported by /health and /ready
        pass


def drain(handle: Handle) -> list:
    events = []
    while not handle.events.empty():
        events.append(handle.events.get_nowait())
    return events


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


@dataclass
class Shape:
    """The OpenAI response and chunk shapes of one request."""

    chat: bool
    id: str
    created: int
    model: str

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, served: Served) -> dict:
        choice = {"index": 0, "finish_reason": served.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": served.text}} if self.chat else {"text": served.text})
        return {**self._head(False), "choices": [choice], "usage": usage(served), "metrics": served.metrics()}

    def chunk(self, text: str = "", role: bool = False, finish: Served | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish.finish_reason if finish else None, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish.finish_reason if finish else None, "logprobs": None}
        out = {**self._head(True), "choices": [choice]}
        if finish is not None:
            out["metrics"] = finish.metrics()
        return out

    def usage_chunk(self, served: Served) -> dict:
        return {**self._head(True), "choices": [], "usage": usage(served)}


def usage(served: Served) -> dict:
    return {"prompt_tokens": served.prompt_tokens, "completion_tokens": served.completion_tokens,
            "total_tokens": served.prompt_tokens + served.completion_tokens}
