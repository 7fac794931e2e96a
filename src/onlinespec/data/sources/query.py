"""A query to the model (:class:`Query`), the error a missing data package raises, and the user
turn every packaged loader builds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class MissingDataError(RuntimeError):
    """A data package is not installed (or could not be fetched); the message says how to fix it."""


@dataclass(frozen=True)
class Query:
    """One request to the model: either a raw ``prompt`` or chat ``messages``, never both.

    Attributes:
        id: Stable identifier, e.g. ``"humaneval/12"``.
        domain: Traffic class, e.g. ``"chat"``, ``"code"``, ``"math"``.
        origin: Where the query came from (a data source's name or a file name).
        prompt: Raw text to continue, without a chat template.
        messages: Chat turns, each a ``{"role": ..., "content": ...}`` dict.
        max_new_tokens: Per-query generation budget; ``None`` uses the caller's default.
        train: Whether the online draft may learn from this query's generation.
        metadata: Other fields of its JSONL line (``source``, ``category``, ...), kept as they
            were and written back; never read by the system.
    """

    id: str
    domain: str
    origin: str
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    max_new_tokens: int | None = None
    train: bool = True
    metadata: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("id", "domain"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"'{name}' must be a non-empty string, got {value!r}")
        _check_text_fields(self.prompt, self.messages)
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        if self.max_new_tokens is not None and (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens <= 0
        ):
            raise ValueError(
                f"'max_new_tokens' must be a positive integer, got {self.max_new_tokens!r}"
            )
        if not isinstance(self.train, bool):
            raise ValueError(f"'train' must be true or false, got {self.train!r}")

    def to_json(self) -> dict[str, Any]:
        """The JSONL form; :func:`read_queries_jsonl` reads it back to an equal query."""
        out: dict[str, Any] = {"id": self.id, "domain": self.domain}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        else:
            out["messages"] = [dict(m) for m in self.messages or ()]
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        if not self.train:
            out["train"] = False
        return {**dict(self.metadata), **out}


def _check_text_fields(prompt: object, messages: object) -> None:
    """Raise ValueError unless exactly one of a non-empty prompt / valid messages is given."""
    if (prompt is None) == (messages is None):
        got = "neither" if prompt is None else "both"
        raise ValueError(
            "set exactly one of 'prompt' (a string) or 'messages' "
            f'(a list of {{"role": ..., "content": ...}} objects); got {got}'
        )
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise ValueError(f"'prompt' must be a non-empty string, got {prompt!r:.80}")
    if messages is not None:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(
                "'messages' must be a non-empty list of "
                f'{{"role": ..., "content": ...}} objects, got {messages!r:.80}'
            )
        for i, message in enumerate(messages):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and message["role"].strip()
                and isinstance(message.get("content"), str)
            ):
                raise ValueError(
                    f"messages[{i}] must be an object with string 'role' and 'content', "
                    f"got {message!r:.80}"
                )


def user_query(id: str, domain: str, origin: str, text: str) -> Query:
    return Query(id=id, domain=domain, origin=origin, messages=({"role": "user", "content": text},))
