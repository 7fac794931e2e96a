"""vLLM's utility routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``.

``/tokenize`` takes ``{"model"?, "prompt"}`` (text; ``add_special_tokens``, default true) or
``{"model"?, "messages"}`` (a chat through the target's template; ``add_generation_prompt``,
default true, ``continue_final_message``, ``add_special_tokens``, default false), and answers
``{"count", "max_model_len", "tokens"}`` (``token_strs`` too with ``return_token_strs``): with
the defaults, the ids a completion or chat request with that prompt is served from.
``/detokenize`` takes ``{"model"?, "tokens"}`` and answers ``{"prompt"}``. Same keys and error
shape as ``/v1``; a bad body is a 4xx naming the field.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from onlinespec.serve.handles import ServeError, Unavailable
from onlinespec.serve.protocol import Message, parse
from onlinespec.serve.web import Access, ServerSettings, read_body
from onlinespec.tokens import NO_CHAT_TEMPLATE


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    def check_extras(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ServeError("give 'prompt' (text) or 'messages' (a chat), exactly one of them", param="prompt" if self.prompt is None else "messages")
        if self.add_generation_prompt and self.continue_final_message:
            raise ServeError("add_generation_prompt and continue_final_message cannot both be true: set add_generation_prompt false "
                             "to continue the last message", param="continue_final_message")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]

    def check_extras(self) -> None:
        pass


def onlinespec_version() -> str:
    try:
        return version("onlinespec")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def tokenizer_router(core, settings: ServerSettings, access: Access) -> APIRouter:
    router = APIRouter()

    def tokenizer():
        loaded = getattr(core, "tokenizer", None) if core.ready else None
        if loaded is None:
            raise Unavailable(f"not ready: the model is {core.status}; retry when GET /ready answers 200")
        return loaded

    async def read(request: Request, kind: type):
        """The request's body as ``kind``, for a model served here, and the tokenizer (the /v1 routes' key check)."""
        access.tenant(request)
        body = parse(await read_body(request, settings.max_body_bytes), kind)
        settings.check_model(body.model)
        return body, tokenizer()

    @router.post("/tokenize")
    async def tokenize(request: Request):
        body, tok = await read(request, TokenizeRequest)
        ids = await asyncio.to_thread(encode, tok, body)
        out = {"count": len(ids), "max_model_len": getattr(core, "context", None), "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    @router.post("/detokenize")
    async def detokenize(request: Request):
        body, tok = await read(request, DetokenizeRequest)
        bad = next(((i, t) for i, t in enumerate(body.tokens) if not 0 <= t < len(tok)), None)
        if bad is not None:
            raise ServeError(f"tokens.{bad[0]}: token id {bad[1]} is not in this model's vocabulary (ids run from 0 to {len(tok) - 1})",
                             param=f"tokens.{bad[0]}")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    @router.get("/version")
    async def version_route():
        return {"version": onlinespec_version()}

    return router


def encode(tokenizer, body: TokenizeRequest) -> list[int]:
    """The prompt's ids as ``body`` asks (the defaults: as a request with it is served)."""
    if body.prompt is not None:
        return tokenizer(body.prompt, add_special_tokens=body.add_special_tokens is not False).input_ids
    messages = [m.as_dict() for m in body.messages]
    if not getattr(tokenizer, "chat_template", None):
        raise ServeError(NO_CHAT_TEMPLATE, param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message, tokenize=False)
    except Exception as err:  # a template that refuses these messages (roles out of order, ...)
        raise ServeError(f"the chat template could not render these messages: {err}", param="messages") from None
    return tokenizer(text, add_special_tokens=bool(body.add_special_tokens)).input_ids
