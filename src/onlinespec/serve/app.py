"""The OpenAI-compatible HTTP API over a serving core (FastAPI), typed against its declared interface,
:class:`~onlinespec.serve.interface.Core`: one process's ``ServingCore`` or the Ray front ``RayCore``.

Routes, one router per concern: OpenAI's API under ``/v1`` (:mod:`onlinespec.serve.openai_routes`),
vLLM's ``/tokenize``, ``/detokenize`` and ``/version`` (:mod:`onlinespec.serve.tokenizer_routes`),
the process's health (``GET /health``: 503 while the model loads, then 200 while the process
serves, 500 if loading failed, as llama-server answers; ``GET /ready``: model loaded and calibrated;
``GET /metrics``: Prometheus text), and the admin API under ``/admin``
(:mod:`onlinespec.serve.admin_routes`). Every error has OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` (:func:`onlinespec.serve.web.error_response`).
"""

from __future__ import annotations

import asyncio
import math
import threading
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from onlinespec.serve.admin_routes import admin_router
from onlinespec.serve.handles import NotFound, ServeError
from onlinespec.serve.interface import Core
from onlinespec.serve.logs import AccessLog
from onlinespec.serve.openai_routes import openai_router
from onlinespec.serve.tokenizer_routes import tokenizer_router
from onlinespec.serve.web import Access, RefusalLimiter, ServerSettings, error_response

LOADING = ("starting", "loading", "calibrating")  # the statuses before a core first serves (ServingCore's, RayCore's)


def create_app(core: Core, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.load_in_background:
            threading.Thread(target=_load_quietly, args=(core,), name="onlinespec-load", daemon=True).start()
        else:
            await asyncio.to_thread(core.load)
        yield
        await asyncio.to_thread(core.shutdown, drain_seconds=settings.drain_seconds)

    app = FastAPI(title="onlinespec", lifespan=lifespan, docs_url=None, redoc_url=None)
    add_error_handlers(app, RefusalLimiter(settings.refusal_rate))
    app.add_middleware(AccessLog)
    access = Access(settings)
    app.include_router(openai_router(core, settings, access))
    app.include_router(tokenizer_router(core, settings, access))
    app.include_router(health_router(core, settings))
    app.include_router(admin_router(core, settings, access))
    return app


def add_error_handlers(app: FastAPI, refusals: RefusalLimiter | None = None) -> None:
    """Every error, ours, Starlette's (404, 405) or unexpected, answers in OpenAI's shape; a
    caller's 401s and 403s past its rate wait first (``refusals``)."""

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, err: ServeError):
        response = error_response(err, request.headers.get("x-request-id"))
        wait = refusals.wait(request, err.status) if refusals is not None else 0.0
        if wait:
            response.headers["Retry-After"] = str(math.ceil(wait))
            await asyncio.sleep(wait)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = NotFound if err.status_code == 404 else ServeError
        error = kind(f"{request.method} {request.url.path}: {err.detail}")
        error.status = err.status_code
        return error_response(error)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception):
        error = ServeError(f"internal error: {type(err).__name__}: {err}")
        error.status, error.kind = 500, "internal_error"
        return error_response(error)


def health_router(core: Core, settings: ServerSettings) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        if core.status == "failed":
            return JSONResponse({"status": "failed", "error": core.error}, status_code=500)
        if core.status in LOADING:
            return JSONResponse({"status": "loading", "model": core.status}, status_code=503)
        return {"status": "alive", "model": core.status}

    @router.get("/ready")
    async def ready():
        if not core.ready:
            return JSONResponse({"status": core.status, "error": core.error}, status_code=503)
        learning = await asyncio.to_thread(core.learning)  # a cluster asks its actors: never on the event loop
        return {"status": "ready", "model": settings.model_name, "draft": core.config.draft, **learning}

    access = Access(settings)

    @router.get("/metrics")
    async def metrics(request: Request):
        access.metrics(request)  # issue 46: its labels are client-chosen (domains): behind a key when keys guard /v1
        text = await asyncio.to_thread(core.metrics.text)  # a cluster gathers its replicas': never on the event loop
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return router


def _load_quietly(core: Core) -> None:
    try:
        core.load()
    except Exception:  # reported by /health and /ready
        pass
