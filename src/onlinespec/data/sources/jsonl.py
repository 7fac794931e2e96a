"""Query files: one JSON object per line."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from onlinespec.data.sources.query import Query
from onlinespec.safety import near_miss

_JSONL_KEYS = ("id", "domain", "prompt", "messages", "max_new_tokens", "train")


def _query_from_json_line(line: str, default_id: str, origin: str) -> Query:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON object "
            'such as {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}'
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(f"each line must be a JSON object, got a JSON {type(obj).__name__}")
    for key in obj:  # other keys are kept as metadata, but a misspelt field (an opt-out!) must not be
        near = near_miss(key, _JSONL_KEYS)
        if near:
            raise ValueError(f"unknown key {key!r}: did you mean {near!r}? (fields: {', '.join(_JSONL_KEYS)})")
    return Query(
        id=obj.get("id", default_id),
        domain=obj.get("domain", "default"),
        origin=origin,
        prompt=obj.get("prompt"),
        messages=obj.get("messages"),
        max_new_tokens=obj.get("max_new_tokens"),
        train=obj.get("train", True),
        metadata=tuple((k, v) for k, v in obj.items() if k not in _JSONL_KEYS),
    )


def read_queries_jsonl(path: str | os.PathLike[str]) -> list[Query]:
    """Read queries, one JSON object per line (blank lines skipped).

    Keys: ``prompt`` xor ``messages`` (required); ``domain`` (default ``"default"``); ``id``
    (default ``<file stem>/<line number>``, must be unique); ``max_new_tokens``; ``train``.
    Other keys (a ``source`` or ``category`` column) are kept as each query's ``metadata``, with
    one warning per file naming them; a key close to a field's name (``Train``, ``promt``) is
    an error that names the field. Raises
    ``ValueError("<path>:<line>: <what to fix>")`` on the first bad line.
    """
    path = Path(path)
    queries: list[Query] = []
    first_line_of: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                query = _query_from_json_line(line, f"{path.stem}/{lineno}", path.name)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            if query.id in first_line_of:
                raise ValueError(
                    f"{path}:{lineno}: duplicate id {query.id!r} (first used on line "
                    f"{first_line_of[query.id]}); give each query a unique 'id'"
                )
            first_line_of[query.id] = lineno
            queries.append(query)
    extra = sorted({key for q in queries for key, _ in q.metadata})
    if extra:
        logging.getLogger("onlinespec.data").warning(
            "%s: key(s) %s are not query fields (%s): kept as metadata, not used", path, ", ".join(map(repr, extra)),
            ", ".join(_JSONL_KEYS))
    return queries


def write_queries_jsonl(path: str | os.PathLike[str], queries: Iterable[Query]) -> None:
    """Write queries as UTF-8 JSONL, one :meth:`Query.to_json` per line; creates parent dirs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for query in queries:
            f.write(json.dumps(query.to_json(), ensure_ascii=False) + "\n")
