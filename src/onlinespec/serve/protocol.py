"""The OpenAI request bodies we accept, and the checks that turn a bad one into a clear error.

Status codes (docs/serve.md): a body that is not JSON, or not an object, is 400; a body whose
fields have the wrong type, a missing field or a value out of range is 422, naming the field; a
well-formed request we cannot serve as asked (options we do not implement, a prompt past the
context, more choices than :data:`MAX_CHOICES`) is 400. Nothing is dropped silently: an option
that would change the output and that we do not implement is refused, not ignored.

vLLM's sampling extras that are logits processors (``min_p``, ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``top_k: -1``) and OpenAI's penalties and ``logit_bias`` act
on the target's distribution before verification (:mod:`onlinespec.decoding.processors`), so the
output follows the processed target exactly. The rest of vLLM's extras (:data:`VLLM_EXTRAS`) are
a 400 unless at their neutral value.

How a prompt is rendered (vLLM's ``add_generation_prompt``, ``continue_final_message``,
``add_special_tokens``, ``chat_template_kwargs``): :mod:`onlinespec.serve.prompts`. Chat's ``echo``
puts the last message's content before the answer when the answer continues that message's
role (as vLLM). Structured output (``response_format``, vLLM's ``guided_*`` and
``structured_outputs``, llama-server's ``grammar`` / ``json_schema``) and tool calls (``tools``,
``tool_choice``, ``role: "tool"`` messages), in the chat template's own format where it has one:
:mod:`onlinespec.serve.tools`.

Unknown fields: a near miss of a known one (``"Train": false``, ``"max_token"``) is a 400 that
names the field meant, so a misspelt opt-out is never trained on; any other unknown field is
ignored and named in the response's ``X-Ignored-Fields`` header (:meth:`_Common.ignored_fields`).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from onlinespec.decoding.sampling import MAX_LOGPROBS, SamplingParams
from onlinespec.safety import near_miss, shown
from onlinespec.serve.handles import ServeError, Unprocessable
from onlinespec.serve.prompts import ChatPrompt, TextPrompt, check_chat_options
from onlinespec.serve.structured import STRUCTURED_FIELDS, constraint_of
from onlinespec.serve.tools import GENERIC, ToolFormat, chosen_tools, tool_functions

MAX_STOP = 16  # stop sequences per request (OpenAI allows 4, vLLM any number; lm-eval tasks send up to 6 or so)
MAX_STOP_CHARS = 1000  # characters per stop sequence
MAX_CHOICES = 16  # choices per request (prompts x n): each is a request of its own in the batch
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
DEFAULT_TEMPERATURE = 1.0  # a request without temperature samples, as OpenAI and vLLM do: the server's one default
# vLLM's extra request fields that change the output and that we do not implement, at their
# neutral values: anything else is a 400
VLLM_EXTRAS: dict[str, object] = {
    "length_penalty": 1.0, "use_beam_search": False, "bad_words": None, "allowed_token_ids": None,
    "include_stop_str_in_output": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None, "logits_processors": None, "functions": None, "function_call": None,
    "chat_template": None, "documents": None,
}
TokenId = Annotated[int, Field(ge=0)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


def _neutral(value, neutral) -> bool:
    return value == neutral or (neutral is None and value in ([], {}, 0)) or (neutral == 0 and value is None)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # as vLLM accepts it: 0 or -1 is off
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
    # vLLM's: the prefix cache reuses cells of requests with the same salt (and tenant) only
    cache_salt: str | None = Field(None, min_length=1, max_length=1000)
    # processors of the target's distribution (OpenAI's, then vLLM's extras)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    prompt_logprobs: Logprobs | None = None  # vLLM's: every prompt token's log probability (and the top n)
    response_format: dict | None = None  # text, json_object or json_schema (onlinespec.serve.structured)
    priority: int = Field(0, ge=-(1 << 31), lt=1 << 31)  # vLLM's: lower first, among the caller's tenant's requests (docs/serve.md, "Scheduling")

    def ignored_fields(self) -> list[str]:
        """Unknown fields this request sent that change nothing (after :func:`parse`'s checks)."""
        return sorted(key for key in self.model_extra or {} if key not in VLLM_EXTRAS and key not in STRUCTURED_FIELDS)

    def check_extras(self) -> None:
        """400 on a near miss of a known field, or on a vLLM extra set to change the output."""
        known = [*type(self).model_fields, *VLLM_EXTRAS, *STRUCTURED_FIELDS]
        for key, value in (self.model_extra or {}).items():
            if key in STRUCTURED_FIELDS:
                continue
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
        """The sampling parameters, built once: ``max_tokens`` becomes ``max_new_tokens`` (None: the
        server's default or the context left, :func:`onlinespec.serve.admission.admit_budget`);
        400 on what we cannot serve."""
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ServeError(f"min_tokens = {self.min_tokens} is more than max_tokens = {self.max_tokens}", param="min_tokens")
        if self.stream_options is not None and not self.stream:
            raise ServeError("stream_options needs stream: true", param="stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ServeError(f"stop: give at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters", param="stop")
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 9:  # "²" is a digit to str.isdigit, not to int()
                raise Unprocessable(f"logit_bias: the keys are token ids (as strings, e.g. \"50256\"), got {shown(key)}", param="logit_bias")
            bias[int(key)] = value
        return SamplingParams(max_new_tokens=self.max_tokens, temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k or 0, 0),
                              stop_strings=tuple(stops), seed=self.seed, ignore_eos=self.ignore_eos, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, logit_bias=tuple(bias.items()),
                              stop_token_ids=tuple(self.stop_token_ids or ()), min_tokens=self.min_tokens,
                              logprobs=self.logprob_count(), prompt_logprobs=self.prompt_logprob_count(), constraint=self.constraint())

    def constraint(self):
        """The grammar the output must match (:func:`~onlinespec.serve.structured.constraint_of`), or None."""
        return constraint_of(self)

    def logprob_count(self) -> int | None:
        """How many alternatives each new token's log probability comes with (None: no log probabilities)."""
        raise NotImplementedError

    def prompt_logprob_count(self) -> int | None:
        return self.prompt_logprobs

    def choices(self, prompts: int = 1) -> int:
        """How many choices the request asks for (``n`` per prompt); 400 past :data:`MAX_CHOICES`."""
        if self.n * prompts > MAX_CHOICES:
            raise ServeError(f"{prompts} prompt(s) x n = {self.n} asks for {self.n * prompts} choices: this server gives at most "
                             f"{MAX_CHOICES} per request; send several requests", param="n" if self.n > 1 else "prompt")
        return self.n * prompts


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (written back in the tool format's form)
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def as_dict(self, tools: ToolFormat = GENERIC) -> dict:
        content = self.content if isinstance(self.content, str) or self.content is None else "".join(p.text for p in self.content)
        return tools.message("system" if self.role == "developer" else self.role, content or "", self.tool_calls)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True  # false: an answer's first call only (onlinespec.serve.tools)
    # vLLM's rendering options (onlinespec.serve.prompts) and its echo
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict | None = None  # checked by onlinespec.serve.prompts.check_template_kwargs
    echo: bool = False
    _tools: ToolFormat = PrivateAttr(default=GENERIC)  # the chat template's tool format (the server's, by use_tools)

    def use_tools(self, tools: ToolFormat) -> ChatRequest:
        """Render and read tool calls in ``tools``' format (:func:`onlinespec.serve.tools.tool_format`)."""
        self._tools = tools
        return self

    def check_extras(self) -> None:
        """As :meth:`_Common.check_extras`, and ``max_completion_tokens`` (OpenAI's newer name)
        becomes ``max_tokens``: one budget from here on."""
        super().check_extras()
        if self.max_completion_tokens is not None:
            if self.max_tokens not in (None, self.max_completion_tokens):
                raise ServeError("max_tokens and max_completion_tokens disagree: give one", param="max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        for i, message in enumerate(self.messages):
            for key in message.model_extra or {}:
                meant = near_miss(key, type(message).model_fields)
                if meant:
                    raise ServeError(f"messages[{i}]: unknown field {shown(key)}: did you mean {meant!r}?", param=f"messages.{i}.{key}",
                                     code="unknown_field")

    def prompt(self) -> ChatPrompt:
        """The messages, with how to render them (:mod:`onlinespec.serve.prompts`)."""
        messages = [m.as_dict(self._tools) for m in self.messages]
        mode, functions = self.tool_mode()
        check_chat_options(messages, self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)
        variables = dict(self.chat_template_kwargs or {})
        if mode != "none":
            messages, offered = self._tools.prompt(messages, functions)
            variables.update(offered)
        if messages[-1]["role"] == "assistant" and self.add_generation_prompt:
            raise ServeError("the last message is the assistant's: end with a user (or system) message, or send "
                             "continue_final_message: true and add_generation_prompt: false to continue it", param="messages")
        if not any(m["content"].strip() for m in messages):
            raise ServeError("every message is empty: give the model something to answer", param="messages")
        return ChatPrompt(messages, self.add_generation_prompt, self.continue_final_message, self.add_special_tokens, variables)

    def tool_mode(self) -> tuple[str, list[dict]]:
        """(``none`` | ``auto`` | ``required``, the functions the answer may call): :mod:`onlinespec.serve.structured`."""
        return chosen_tools(tool_functions(self.tools), self.tool_choice)

    def constraint(self):
        """A required (or named) tool call constrains the answer to a call; otherwise as any request."""
        mode, functions = self.tool_mode()
        if mode != "required":
            return constraint_of(self)
        if constraint_of(self) is not None:
            raise ServeError("tool_choice required (or a named function) already constrains the output: drop the other constraint",
                             param="tool_choice")
        return self._tools.constraint(functions)

    def reply(self) -> tuple[str, str]:
        """The answer's role and what comes before its text: vLLM's role is the assistant's, or
        without ``add_generation_prompt`` the last message's; ``echo`` puts the last message's
        content first when its role is the answer's."""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        return role, last.as_dict(self._tools)["content"] if self.echo and last.role == role else ""

    def logprob_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ServeError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[TokenId]] = Field(min_length=1)
    echo: bool = False
    logprobs: Logprobs | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (BOS) before a text prompt

    def prompts(self) -> list[TextPrompt | list[int]]:
        """The prompts (several in one request are choices of their own, prompt by prompt); text
        with how to tokenize it (:class:`~onlinespec.serve.prompts.TextPrompt`)."""
        return [TextPrompt(p, self.add_special_tokens) if isinstance(p, str) else p for p in self._prompts()]

    def _prompts(self) -> list[str | list[int]]:
        if self.best_of not in (None, self.n):
            raise ServeError(f"best_of = {self.best_of}: only best_of = n is served (each choice is returned)", param="best_of")
        if self.suffix:
            raise ServeError("suffix is not supported", param="suffix")
        prompts = [self.prompt] if isinstance(self.prompt, str) or isinstance(self.prompt[0], int) else list(self.prompt)
        if any(not p for p in prompts):
            raise ServeError("a prompt is empty", param="prompt")
        self.choices(len(prompts))
        return prompts

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        if self.echo and self.logprobs is not None:  # OpenAI's echo: the prompt's tokens come with log probabilities too
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


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
