"""Prompts to token ids, and a model's end-of-sequence ids: what the engine, the distillation
signal and the bulk warm-up all need, kept below all of them."""

from __future__ import annotations

import hashlib
import json

Prompt = str | list[dict] | list[int]
NO_CHAT_TEMPLATE = ("this model has no chat template (a base model?), so chat messages cannot be turned into a prompt: "
                    "send the text as `prompt` to /v1/completions, or serve the model with --chat-template FILE (a Jinja template)")


def encode_prompt(tokenizer, prompt: Prompt, vocab_size: int | None = None) -> list[int]:
    """Token ids of ``prompt``: ids as they are, text as it is, chat messages through the template.

    Ids given as such must lie in ``[0, vocab_size)`` (the model's and its tokenizer's shared
    range): checked here, before a request joins a batch, so a bad id is a clear error for its
    sender and never an index error inside a step that other requests share."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        ids = list(prompt)
        limit = vocab_size if vocab_size is not None else len(tokenizer)
        bad = next(((i, t) for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < limit), None)
        if bad is not None:
            raise ValueError(f"token id {bad[1]!r} at position {bad[0]} is not in this model's vocabulary: ids run from 0 to {limit - 1}")
    elif isinstance(prompt, list):
        if not any(str(m.get("content") or "").strip() for m in prompt):
            raise ValueError("the prompt is empty: the chat messages have no content")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(NO_CHAT_TEMPLATE)
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"]
    elif isinstance(prompt, str):
        ids = tokenizer(prompt).input_ids
    else:
        raise TypeError(f"prompt must be text, chat messages or token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("the prompt is empty: give at least one character of text or one chat message")
    return ids


def eos_token_ids(model, tokenizer=None) -> frozenset[int]:
    """The ids that end a sequence: the model's generation config, else the tokenizer's."""
    eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else (eos or []))


def tokenizer_fingerprint(tokenizer) -> str:
    """A short name for a tokenizer's vocabulary (its size and a hash of its token -> id map):
    records and drafts made under one tokenizer are never used under another."""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:12]
    return f"vocab{len(vocab)}-{digest}"
