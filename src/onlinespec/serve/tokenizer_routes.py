"""vLLM's utility routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``.

``/tokenize`` takes ``{"model"?, "prompt"}`` (text; ``add_special_tokens``, default true) or
``{"model"?, "messages"}`` (a chat through the target's template; ``add_generation_prompt``,
default true, ``continue_final_message``, ``add_special_tokens``, default false,
``chat_template_kwargs``: :mod:`onlinespec.serve.prompts`; ``tools``, offered as a chat request
offers them: :mod:`onlinespec.serve.tools`), and answers
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
from onlinespec.serve.interface import Core
from onlinespec.serve.prompts import ChatPrompt, TextPrompt, check_chat_options, render
from onlinespec.serve.protocol import Message, parse
from onlinespec.serve.tools import ToolFormat, tool_format, tool_functions
from onlinespec.serve.web import Access, ServerSettings, read_body


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list | None = None  # with messages: offered in the server's tool format, as /v1/chat/completions offers them
    return_token_strs: bool = False

    def check_extras(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ServeError("give 'prompt' (text) or 'messages' (a chat), exactly one of them", param="prompt" if self.prompt is None else "messages")
        if self.messages is not None:
            check_chat_options([m.as_dict() for m in self.messages], self.add_generation_prompt, self.continue_final_message,
                               self.chat_template_kwargs)

    def rendered(self, tools: ToolFormat) -> ChatPrompt | TextPrompt:
        """The prompt with the rendering options asked (vLLM's defaults: true for a prompt's
        special tokens, false for messages'), any ``tools`` offered in the format ``tools``."""
        if self.prompt is not None:
            if self.tools:
                raise ServeError("tools go with messages (a chat), not with a prompt", param="tools")
            return TextPrompt(self.prompt, self.add_special_tokens is not False)
        messages, variables = [m.as_dict(tools) for m in self.messages], dict(self.chat_template_kwargs or {})
        functions = tool_functions(self.tools)
        if functions:
            messages, offered = tools.prompt(messages, functions)
            variables.update(offered)
        return ChatPrompt(messages, self.add_generation_prompt, self.continue_final_message, bool(self.add_special_tokens), variables)


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


def tokenizer_router(core: Core, settings: ServerSettings, access: Access) -> APIRouter:
    router = APIRouter()

    def tokenizer():
        loaded = getattr(core, "tokenizer", None) if core.ready else None
        if loaded is None:
            raise Unavailable(f"not ready: the model is {core.status}; retry when GET /ready answers 200")
        return loaded

    async def read(request: Request, kind: type):
        """The request's body as ``kind``, for a model served here, and the tokenizer (the /v1 routes' key check)."""
        access.tenant(request)
        body = parse(await read_body(request, settings.max_body_bytes, settings.body_timeout), kind)
        settings.check_model(body.model)
        return body, tokenizer()

    @router.post("/tokenize")
    async def tokenize(request: Request):
        body, tok = await read(request, TokenizeRequest)
        prompt = body.rendered(tool_format(tok, settings.tool_call_parser))
        ids = await asyncio.to_thread(render, tok, prompt)
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
