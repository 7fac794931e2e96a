"""Prompts as a request asks for them to be rendered: vLLM's rendering options.

Chat (``/v1/chat/completions``, ``/tokenize`` with ``messages``): ``add_generation_prompt``
(default true: the template's header that opens the assistant's turn), ``continue_final_message``
(the last message, the assistant's, is left open and the model continues it; needs
``add_generation_prompt: false``), ``add_special_tokens`` (default false: the template writes them)
and ``chat_template_kwargs`` (extra variables for the template, e.g. ``enable_thinking``: at most
:data:`MAX_TEMPLATE_KWARGS`, names that are identifiers and not the renderer's own arguments,
values JSON scalars). Text (``/v1/completions``, ``/tokenize`` with ``prompt``): ``add_special_tokens``
(default true: the tokenizer's BOS, for a tokenizer that adds one). Token ids are served as given.

:class:`ChatPrompt` and :class:`TextPrompt` are the messages (a list) and the text (a str) with
these options attached, so they pass through the core unchanged (``--log-text`` logs them as
messages and text, a Ray replica gets them pickled whole) until :func:`render` turns them into ids.
"""

from __future__ import annotations

import math

from onlinespec.safety import shown
from onlinespec.serve.handles import ServeError, Unprocessable
from onlinespec.tokens import NO_CHAT_TEMPLATE

MAX_TEMPLATE_KWARGS = 16  # chat_template_kwargs entries
MAX_TEMPLATE_NAME = 64  # characters of an entry's name
MAX_TEMPLATE_TEXT = 1000  # characters of a string value
# what apply_chat_template and its renderer take themselves: a request sets them through its own fields, or not at all
RENDERER_ARGUMENTS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs",
})


class ChatPrompt(list):
    """Chat messages (``{"role", "content"}`` dicts) and how to render them (see the module docstring)."""

    def __init__(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
                 add_special_tokens: bool = False, template_kwargs: dict | None = None) -> None:
        super().__init__(messages)
        self.add_generation_prompt, self.continue_final_message = add_generation_prompt, continue_final_message
        self.add_special_tokens, self.template_kwargs = add_special_tokens, dict(template_kwargs or {})


class TextPrompt(str):
    """A text prompt and whether the tokenizer adds its special tokens (BOS) to it."""

    add_special_tokens: bool

    def __new__(cls, text: str, add_special_tokens: bool = True) -> TextPrompt:
        prompt = super().__new__(cls, text)
        prompt.add_special_tokens = add_special_tokens
        return prompt


def check_chat_options(messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                       template_kwargs: dict | None) -> None:
    """A 400 naming the field for options vLLM refuses too: ``continue_final_message`` with
    ``add_generation_prompt``, or without an assistant's message to continue; and
    :func:`check_template_kwargs`."""
    if continue_final_message and add_generation_prompt:
        raise ServeError("add_generation_prompt and continue_final_message cannot both be true: set add_generation_prompt false "
                         "to continue the last message", param="continue_final_message")
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise ServeError("continue_final_message continues the last message, which must be the assistant's "
                         f"(it is the {shown(messages[-1]['role'])} one)", param="continue_final_message")
    check_template_kwargs(template_kwargs or {})


def check_template_kwargs(template_kwargs: dict) -> None:
    """``chat_template_kwargs`` are bounded: at most :data:`MAX_TEMPLATE_KWARGS` variables, each
    named as a template variable is, with a JSON scalar for a value (a 422 naming it otherwise);
    a name the renderer sets itself is a 400."""
    if len(template_kwargs) > MAX_TEMPLATE_KWARGS:
        raise Unprocessable(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} variables, got {len(template_kwargs)}",
                            param="chat_template_kwargs")
    for key, value in template_kwargs.items():
        where = f"chat_template_kwargs.{key}"[:100]
        if not key.isidentifier() or not key.isascii() or key.startswith("_") or len(key) > MAX_TEMPLATE_NAME:
            raise Unprocessable(f"chat_template_kwargs: {shown(key)} is not a template variable's name (ASCII letters, digits "
                                f"and _, at most {MAX_TEMPLATE_NAME} characters, not starting with _)", param="chat_template_kwargs")
        if key in RENDERER_ARGUMENTS:
            raise ServeError(f"chat_template_kwargs: {key!r} is the renderer's own argument, not a template variable "
                             "(add_generation_prompt and continue_final_message are request fields)", param=where)
        scalar = value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and math.isfinite(value))
        if not scalar or (isinstance(value, str) and len(value) > MAX_TEMPLATE_TEXT):
            raise Unprocessable(f"{where}: give a string (at most {MAX_TEMPLATE_TEXT} characters), a number, true, false "
                                f"or null, got {shown(value)}", param=where)


def render(tokenizer, prompt: ChatPrompt | TextPrompt) -> list[int]:
    """The prompt's token ids, rendered as its options ask (with the defaults, as
    :func:`onlinespec.tokens.encode_prompt` renders the bare messages or text)."""
    if isinstance(prompt, TextPrompt):
        return tokenizer(str(prompt), add_special_tokens=prompt.add_special_tokens).input_ids
    if not getattr(tokenizer, "chat_template", None):
        raise ServeError(NO_CHAT_TEMPLATE, param="messages")
    try:
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=prompt.add_generation_prompt,
                                             continue_final_message=prompt.continue_final_message, tokenize=False,
                                             **prompt.template_kwargs)
    except Exception as err:  # a template that refuses these messages (roles out of order, nothing to continue, ...)
        raise ServeError(f"the chat template could not render these messages: {err}", param="messages") from None
    return tokenizer(text, add_special_tokens=prompt.add_special_tokens).input_ids
