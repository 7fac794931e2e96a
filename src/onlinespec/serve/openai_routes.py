"""OpenAI's API: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``) and
``GET /v1/models``.

A handler never blocks the event loop: the core's threads push each request's events, and a
wake-up crosses into the loop with ``call_soon_threadsafe``. A client that disconnects, mid-stream
or while waiting, cancels its request; its slot frees at the next engine step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from onlinespec.safety import shown
from onlinespec.serve.core import ServingCore
from onlinespec.serve.handles import Delta, Events, NotFound, Served, ServeError
from onlinespec.serve.protocol import ChatRequest, CompletionRequest, parse
from onlinespec.serve.web import Access, ServerSettings, error_response, read_body

POLL_DISCONNECT = 0.5  # seconds between checks that a waiting (non-streaming) client is still there


def openai_router(core: ServingCore, settings: ServerSettings, access: Access) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(core, settings, access, request, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await complete(core, settings, access, request, chat=False)

    @router.get("/v1/models")
    async def models(request: Request):
        access.tenant(request)
        cards = [{"id": name, "object": "model", "created": int(core.started_at), "owned_by": "onlinespec",
                  "root": settings.model_name, "max_model_len": getattr(core, "context", None)} for name in settings.names]
        return {"object": "list", "data": cards}

    return router


async def complete(core: ServingCore, settings: ServerSettings, access: Access, request: Request, chat: bool):
    """Submit the request to the core; answer with its SSE stream, or wait for its end."""
    tenant = access.tenant(request)
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    if len(request_id) > 128 or not request_id.isprintable():
        raise ServeError("X-Request-Id: give at most 128 printable characters", param="X-Request-Id", code="invalid_request_id")
    body = parse(await read_body(request, settings.max_body_bytes), ChatRequest if chat else CompletionRequest)
    if body.model not in settings.names:
        raise NotFound(f"model {shown(body.model)} is not served here: use {' or '.join(map(repr, settings.names))} (GET /v1/models)",
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
    return await answer(handle, wake, shape, request, headers)


async def answer(handle: Events, wake: asyncio.Event, shape: Shape, request: Request, headers: dict):
    """Wait for the request's end and answer it whole; a client gone meanwhile cancels it (499)."""
    try:
        while True:
            for event in drain(handle):
                if isinstance(event, ServeError):
                    return error_response(event, headers["X-Request-Id"])
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


async def stream(handle: Events, wake: asyncio.Event, shape: Shape, usage: bool):
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


def drain(handle: Events) -> list:
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
