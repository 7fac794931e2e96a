"""OpenAI's response and chunk shapes, log probabilities included.

Chat's ``logprobs`` is ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``; the legacy
completions' is ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, with the prompt's
tokens first when ``echo`` is on (the first prompt token has no log probability: ``None``).
vLLM's ``prompt_logprobs`` (either API) is a list with ``None`` for the first prompt token, then
``{token id: {"logprob", "rank", "decoded_token"}}`` per token. Each figure is the target's own
(:mod:`onlinespec.decoding.logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from onlinespec.decoding.logprobs import TokenLogprob
from onlinespec.serve.handles import Served
from onlinespec.serve.tools import GENERIC, ToolFormat


class TokenText:
    """Token ids as text, one id at a time (what a log probability is about), with their bytes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def bytes(self, token: int) -> list[int]:
        """The token's own bytes: a byte-level BPE token may hold part of a character, which its text cannot show."""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        decoder = getattr(self.tokenizer, "byte_decoder", None) or _byte_decoder()
        if isinstance(piece, str) and all(c in decoder for c in piece):
            return [decoder[c] for c in piece]
        return list(self.text(token).encode())

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed (what ``bytes_to_unicode`` maps each byte to)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


@dataclass
class Shape:
    """The OpenAI response and chunk shapes of one request."""

    chat: bool
    id: str
    created: int
    model: str
    words: TokenText | None = None
    echo: bool = False
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field was sent
    n: int = 1  # choices per prompt (they come prompt by prompt)
    role: str = "assistant"  # chat: the answer's role (vLLM's: the last message's without add_generation_prompt)
    echoed: str = ""  # chat: what comes before each choice's text (vLLM's echo: the last message's content)
    tools: list[dict] | None = None  # chat with tools the answer may call: its text is read as calls (onlinespec.serve.tools)
    tool_format: ToolFormat = GENERIC  # how calls are written (the chat template's format)
    parallel_tool_calls: bool = True  # false: an answer's first call only

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, served: list[Served]) -> dict:
        choices = [self._choice(i, s) for i, s in enumerate(served)]
        return {**self._head(False), "choices": choices, "usage": usage(served, self.n), "metrics": served[0].metrics()}

    def _choice(self, index: int, served: Served) -> dict:
        choice = {"index": index, "finish_reason": served.finish_reason, "logprobs": None}
        called = self.tool_calls(served)
        if called:
            content, calls = called
            choice["message"] = {"role": self.role, "content": content, "tool_calls": calls}
            choice["finish_reason"] = "tool_calls"
        elif self.chat:
            choice["message"] = {"role": self.role, "content": self.echoed + served.text}
            if served.logprobs is not None:
                choice["logprobs"] = {"content": self.chat_logprobs(served.logprobs)}
        else:
            prompt = self.words.decode(served.prompt_ids) if self.echo else ""
            choice["text"] = prompt + served.text
            if served.logprobs is not None:
                echoed = served.prompt_logprobs if self.echo else None
                choice["logprobs"] = self.completion_logprobs(served.logprobs, served.prompt_ids if self.echo else [], echoed)
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(served.prompt_logprobs or [])
        return choice

    def chunk(self, index: int = 0, text: str = "", role: bool = False, finish: Served | None = None,
              logprobs: list[TokenLogprob] | None = None, offset: int = 0) -> dict:
        if self.chat:
            delta = {"role": self.role, "content": self.echoed} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": finish.finish_reason if finish else None, "logprobs": None}
            if logprobs:
                choice["logprobs"] = {"content": self.chat_logprobs(logprobs)}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish.finish_reason if finish else None, "logprobs": None}
            if logprobs:
                choice["logprobs"] = self.completion_logprobs(logprobs, [], None, offset)
        out = {**self._head(True), "choices": [choice]}
        if finish is not None:
            out["metrics"] = finish.metrics()
        return out

    def tool_calls(self, served: Served) -> tuple[str | None, list[dict]] | None:
        """(its content, the calls) of a finished answer that makes calls, when tools were offered and it ended by itself."""
        if not self.chat or not self.tools or served.finish_reason != "stop":
            return None
        called = self.tool_format.parse(served.text, self.tools)
        return called if called is None or self.parallel_tool_calls else (called[0], called[1][:1])

    def finish_chunks(self, index: int, served: Served) -> list[dict]:
        """A stream's last chunks of a choice. With tools, its text was held back (it may be a
        call): the calls as OpenAI streams them (a delta naming each, then its arguments), or
        the text; then the finish reason."""
        if not self.tools:
            return [self.chunk(index, finish=served)]
        called = self.tool_calls(served)
        if not called:
            return [self.chunk(index, text=served.text), self.chunk(index, finish=served)] if served.text else [self.chunk(index, finish=served)]
        content, calls = called
        chunks = [self.chunk(index, text=content)] if content else []
        for i, call in enumerate(calls):
            head = {"index": i, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"], "arguments": ""}}
            chunks.append(self._delta(index, {"tool_calls": [head]}))
            chunks.append(self._delta(index, {"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]}))
        last = self.chunk(index, finish=served)
        last["choices"][0]["finish_reason"] = "tool_calls"
        return [*chunks, last]

    def _delta(self, index: int, delta: dict) -> dict:
        return {**self._head(True), "choices": [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}]}

    def usage_chunk(self, served: list[Served]) -> dict:
        return {**self._head(True), "choices": [], "usage": usage(served, self.n)}

    # ---- log probabilities ----------------------------------------------------------------------

    def chat_logprobs(self, logprobs: list[TokenLogprob]) -> list[dict]:
        words = self.words
        entry = lambda token, logprob: {"token": words.text(token), "logprob": logprob, "bytes": words.bytes(token)}  # noqa: E731
        return [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]} for x in logprobs]

    def completion_logprobs(self, logprobs: list[TokenLogprob], prompt_ids: list[int] | tuple[int, ...],
                            prompt_logprobs: list[TokenLogprob | None] | None, offset: int = 0) -> dict:
        """Legacy completions' shape; with ``prompt_ids`` (echo), the prompt's tokens come first."""
        words = self.words
        scored: list[tuple[int, TokenLogprob | None]] = []
        if prompt_ids:
            given = prompt_logprobs or [None] * len(prompt_ids)
            scored = [(t, given[i] if i < len(given) else None) for i, t in enumerate(prompt_ids)]
        scored += [(x.token, x) for x in logprobs]
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, x in scored:
            text = words.text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if x is None else x.logprob)
            out["top_logprobs"].append(None if x is None else _top(words, x))
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def vllm_prompt_logprobs(self, prompt_logprobs: list[TokenLogprob | None]) -> list[dict | None]:
        words = self.words
        out: list[dict | None] = []
        for x in prompt_logprobs:
            if x is None:
                out.append(None)
                continue
            entry = {str(x.token): {"logprob": x.logprob, "rank": x.rank, "decoded_token": words.text(x.token)}}
            for rank, (t, v) in enumerate(x.top, 1):
                entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": words.text(t)})
            out.append(entry)
        return out


def _top(words: TokenText, x: TokenLogprob) -> dict[str, float]:
    """The chosen token and the most likely ones, by text (OpenAI's shape: two tokens with one text keep the better)."""
    top: dict[str, float] = {}
    for t, v in ((x.token, x.logprob), *x.top):
        text = words.text(t)
        top[text] = max(v, top.get(text, float("-inf")))
    return top


def usage(served: list[Served], n: int = 1) -> dict:
    """Prompt tokens once per prompt (its ``n`` choices share it), completion tokens of every choice;
    ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache served, once per prompt."""
    prompt_tokens = sum(s.prompt_tokens for s in served[::n])
    completion = sum(s.completion_tokens for s in served)
    cached = sum(max(s.stats.cached_tokens for s in served[i: i + n]) for i in range(0, len(served), n))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
