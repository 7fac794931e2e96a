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
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.safety import shown
from onlinespec.serve.handles import Delta, Events, NotFound, Served, ServeError
from onlinespec.serve.interface import Core
from onlinespec.serve.protocol import ChatRequest, CompletionRequest, parse
from onlinespec.serve.shapes import Shape, TokenText
from onlinespec.serve.structured import check
from onlinespec.serve.tools import tool_format
from onlinespec.serve.web import Access, ServerSettings, error_response, read_body

POLL_DISCONNECT = 0.5  # seconds between checks that a waiting (non-streaming) client is still there


def openai_router(core: Core, settings: ServerSettings, access: Access) -> APIRouter:
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


async def complete(core: Core, settings: ServerSettings, access: Access, request: Request, chat: bool):
    """Submit the request's choices to the core (one request each: ``n`` per prompt); answer with
    their SSE stream, or wait for their end."""
    tenant = access.tenant(request)
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    if len(request_id) > 128 or not request_id.isprintable():
        raise ServeError("X-Request-Id: give at most 128 printable characters", param="X-Request-Id", code="invalid_request_id")
    body = parse(await read_body(request, settings.max_body_bytes, settings.body_timeout), ChatRequest if chat else CompletionRequest)
    if body.model not in settings.names:
        raise NotFound(f"model {shown(body.model)} is not served here: use {' or '.join(map(repr, settings.names))} (GET /v1/models)",
                       param="model", code="model_not_found")
    tools = tool_format(core.tokenizer, settings.tool_call_parser)
    prompts = [body.use_tools(tools).prompt()] if chat else body.prompts()
    body.choices(len(prompts))
    params = body.sampling()
    await asyncio.to_thread(check, params.constraint, core.tokenizer, getattr(core, "eos", ()))  # a bad grammar: 400 before any work
    loop, wake = asyncio.get_running_loop(), asyncio.Event()

    def notify() -> None:
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    handles: list[Events] = []
    try:
        for i, prompt in enumerate(prompts):
            for j in range(body.n):  # a prompt's first choice alone is stored for learning: the others add nothing new
                # every choice of every prompt goes by the id the client gets back (its records, index entries and
                # event-log lines): a purge of that id reaches them all
                handles.append(await asyncio.to_thread(
                    core.submit, prompt, params=choice_params(params, j), domain=body.domain or "default", train=body.train and j == 0,
                    draft=body.draft, request_id=request_id, notify=notify, stream=body.stream, tenant=tenant,
                    cache_salt=body.cache_salt, priority=body.priority))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    role, echoed = body.reply() if chat else ("assistant", "")
    shape = Shape(chat, f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", int(time.time()), settings.model_name,
                  TokenText(core.tokenizer), echo=not chat and body.echo, prompt_logprobs=body.prompt_logprobs is not None, n=body.n,
                  role=role, echoed=echoed, tools=_offered(body) if chat else None, tool_format=tools,
                  parallel_tool_calls=not chat or body.parallel_tool_calls)
    headers = {"X-Request-Id": request_id}
    ignored = body.ignored_fields()
    if ignored:  # unknown fields that change nothing: said, not silently dropped
        names = (k if k.isascii() and k.isprintable() else ascii(k) for k in ignored)
        headers["X-Ignored-Fields"] = ", ".join(names)[:1000]
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(stream(handles, wake, shape, usage), media_type="text/event-stream", headers=headers)
    return await answer(handles, wake, shape, request, headers)


def _offered(body: ChatRequest) -> list[dict] | None:
    """The functions a chat answer may call (its text is then read as calls), or None."""
    mode, functions = body.tool_mode()
    return functions if mode != "none" else None


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """The ``j``-th choice of a prompt: a seeded request's choices draw from seeds seed, seed + 1, ..."""
    return params if j == 0 or params.seed is None else replace(params, seed=(params.seed + j) % (1 << 64))


async def answer(handles: list[Events], wake: asyncio.Event, shape: Shape, request: Request, headers: dict):
    """Wait for every choice's end and answer them whole; a client gone meanwhile cancels them (499)."""
    served: list[Served | None] = [None] * len(handles)
    try:
        while True:
            for i, handle in enumerate(handles):
                for event in drain(handle):
                    if isinstance(event, ServeError):
                        cancel(handles)
                        return error_response(event, headers["X-Request-Id"])
                    if isinstance(event, Served):
                        served[i] = event
            if all(s is not None for s in served):  # built and serialised off the event loop: log probabilities can be large
                return await asyncio.to_thread(lambda: JSONResponse(shape.response(served), headers=headers))
            try:
                await asyncio.wait_for(wake.wait(), POLL_DISCONNECT)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    cancel(handles)
                    return Response(status_code=499)
            wake.clear()
    except asyncio.CancelledError:
        cancel(handles)
        raise


async def stream(handles: list[Events], wake: asyncio.Event, shape: Shape, usage: bool):
    """SSE events: per choice, a first chunk with the role (chat), one per verified round, the
    last with the finish reason and the speculation figures; the usage chunk when asked; [DONE]."""
    served: list[Served | None] = [None] * len(handles)
    offsets = [0] * len(handles)  # text_offset of each choice's next token (completions' log probabilities)
    try:
        if shape.chat:
            for i in range(len(handles)):
                yield sse(shape.chunk(i, role=True))
        while True:
            wake.clear()
            for i, handle in enumerate(handles):
                for event in drain(handle):
                    if isinstance(event, Delta) and (event.text or event.logprobs) and not shape.tools:  # with tools: held back (a call?)
                        yield sse(shape.chunk(i, text=event.text, logprobs=event.logprobs, offset=offsets[i]))
                        offsets[i] += sum(len(shape.words.text(x.token)) for x in event.logprobs or ())
                    elif isinstance(event, ServeError):
                        yield sse({"error": {"message": event.message, "type": event.kind, "param": event.param, "code": event.code}})
                        yield "data: [DONE]\n\n"
                        return
                    elif isinstance(event, Served):
                        served[i] = event  # its last chunks carry its prompt's log probabilities: built off the event loop
                        for chunk in await asyncio.to_thread(lambda i=i, event=event: [sse(c) for c in shape.finish_chunks(i, event)]):
                            yield chunk
            if all(s is not None for s in served):
                if usage:
                    yield sse(shape.usage_chunk(served))
                yield "data: [DONE]\n\n"
                return
            await wake.wait()
    finally:
        cancel(handles)  # the client went away, the server is stopping, or a choice failed: free the slots


def cancel(handles: list[Events]) -> None:
    for handle in handles:
        if not handle.done:
            handle.cancel()


def drain(handle: Events) -> list:
    events = []
    while not handle.events.empty():
        events.append(handle.events.get_nowait())
    return events


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
