"""The OpenAI request bodies we accept, and the checks that turn a bad one into a clear error.

Status codes (docs/serve.md): a body that is not JSON, or not an object, is 400; a body whose
fields have the wrong type, a missing field or a value out of range is 422, naming the field; a
well-formed request we cannot serve as asked (``n`` > 1, options we do not implement, a prompt
past the context) is 400. Nothing is dropped silently: an option that would change the output
and that we do not implement is refused, not ignored.

Unknown fields: a near miss of a known one (``"Train": false``, ``"max_token"``) is a 400 that
names the field meant, so a misspelt opt-out is never trained on; vLLM's sampling extras
(:data:`VLLM_EXTRAS`) are a 400 unless at their neutral value; any other unknown field is ignored
and named in the response's ``X-Ignored-Fields`` header (:meth:`_Common.ignored_fields`).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.safety import near_miss, shown
from onlinespec.serve.handles import ServeError

MAX_STOP = 4  # stop sequences per request, as OpenAI allows
MAX_STOP_CHARS = 1000  # characters per stop sequence
# vLLM's extra request fields that change the output, at their neutral values: anything else is a 400
VLLM_EXTRAS: dict[str, object] = {
    "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "length_penalty": 1.0, "use_beam_search": False,
    "stop_token_ids": None, "bad_words": None, "allowed_token_ids": None, "include_stop_str_in_output": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "prompt_logprobs": None,
    "truncate_prompt_tokens": None, "guided_json": None, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None, "structured_outputs": None, "logits_processors": None, "top_logprobs": None,
    "functions": None, "function_call": None,
}


def _neutral(value, neutral) -> bool:
    return value == neutral or (neutral is None and value in ([], {}, 0)) or (neutral == 0 and value is None)


class Unprocessable(ServeError):
    status = 422


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # as vLLM accepts it
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # what a torch generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = None
    ignore_eos: bool = False
    # onlinespec's own fields (sent as the openai client's extra_body)
    domain: str | None = None  # routing hint: the draft of this domain serves it (a label: onlinespec.safety.LABEL)
    train: bool = True  # False: never stored, never trained on
    draft: str | None = None  # serve with this draft by name ("static", "none", or a draft's name)
    # OpenAI options that change the output and that we do not implement: refused unless neutral
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    logprobs: bool | int | None = None

    def ignored_fields(self) -> list[str]:
        """Unknown fields this request sent that change nothing (after :func:`parse`'s checks)."""
        return sorted(key for key in self.model_extra or {} if key not in VLLM_EXTRAS)

    def check_extras(self) -> None:
        """400 on a near miss of a known field, or on a vLLM extra set to change the output."""
        known = [*type(self).model_fields, *VLLM_EXTRAS]
        for key, value in (self.model_extra or {}).items():
            if key in VLLM_EXTRAS:
                if not _neutral(value, VLLM_EXTRAS[key]):
                    raise ServeError(f"{key} = {shown(value)} is not supported by this server: it would change the output; "
                                     f"leave it out", param=key, code="unsupported_parameter")
                continue
            meant = near_miss(key, known)
            if meant:
                raise ServeError(f"unknown field {shown(key)}: did you mean {meant!r}? (a misspelt field is refused, not "
                                 f"ignored: it could be an opt-out)", param=key, code="unknown_field")

    def sampling(self) -> SamplingParams:
        """The sampling parameters (the budget is :meth:`limits`'s); 400 on what we cannot serve."""
        if self.n != 1:
            raise ServeError(f"n = {self.n}: this server returns one choice per request; send n = 1 (or several requests)", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ServeError(f"{name} is not supported: it would change the target's distribution; leave it at 0", param=name)
        if self.logit_bias:
            raise ServeError("logit_bias is not supported", param="logit_bias")
        if self.logprobs:
            raise ServeError("logprobs are not supported yet", param="logprobs")
        if self.stream_options is not None and not self.stream:
            raise ServeError("stream_options needs stream: true", param="stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ServeError(f"stop: give at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters", param="stop")
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                              stop_strings=tuple(stops), seed=self.seed, ignore_eos=self.ignore_eos)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def check_extras(self) -> None:
        super().check_extras()
        for i, message in enumerate(self.messages):
            for key in message.model_extra or {}:
                meant = near_miss(key, type(message).model_fields)
                if meant:
                    raise ServeError(f"messages[{i}]: unknown field {shown(key)}: did you mean {meant!r}?", param=f"messages.{i}.{key}",
                                     code="unknown_field")

    def prompt(self) -> list[dict]:
        if self.tools or self.tool_choice not in (None, "none"):
            raise ServeError("tools are not supported by this server", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ServeError("response_format: only {'type': 'text'} is supported", param="response_format")
        messages = [m.as_dict() for m in self.messages]
        if messages[-1]["role"] == "assistant":
            raise ServeError("the last message is the assistant's: end with a user (or system) message", param="messages")
        if not any(m["content"].strip() for m in messages):
            raise ServeError("every message is empty: give the model something to answer", param="messages")
        return messages

    def limits(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise ServeError("max_tokens and max_completion_tokens disagree: give one", param="max_completion_tokens")
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] = Field(min_length=1)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def text(self) -> str | list[int]:
        if self.echo:
            raise ServeError("echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise ServeError("best_of must be 1", param="best_of")
        if self.suffix:
            raise ServeError("suffix is not supported", param="suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) > 1:
                raise ServeError(f"{len(self.prompt)} prompts in one request: send one prompt per request", param="prompt")
            return self.prompt[0]
        if isinstance(self.prompt, str) and not self.prompt:
            raise ServeError("the prompt is empty", param="prompt")
        return self.prompt

    def limits(self) -> int | None:
        return self.max_tokens


def _union_tag(part) -> bool:
    """Pydantic names the member of a union it tried in an error's location ('str', 'list[int]'): not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part or part.startswith("function-"))


def parse(body: bytes, model: type[_Common]) -> _Common:
    """A request body as ``model``, or the error that says what to fix."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise ServeError(f"the body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise ServeError("the body's JSON is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ServeError(f"the body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        body = model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if not _union_tag(part))
        more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise Unprocessable(f"{where}: {first['msg']}{more}", param=where or None, code=first["type"]) from None
    body.check_extras()
    return body
