"""Prompts from this machine's Python standard library: real code and documentation nobody here
wrote, with no download."""

from __future__ import annotations

import itertools

from onlinespec.data.sources.query import MissingDataError, Query

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
    queries: list[Query] = []
    for name, node, body in _functions(min_chars, max_chars):
        cut = body.rfind("\n", 0, len(body) * 2 // 3)
        queries.append(Query(f"stdlib/{name}.{node.name}:{node.lineno}", "stdlib", "stdlib", prompt=body[: cut + 1]))
    return queries


def edit_prompts(n: int, min_chars: int = 300, max_chars: int = 900) -> list[Query]:
    """Code-editing requests whose answers quote their prompt (domain ``edit``, chat): the first
    function of each standard-library module ``min_chars``-``max_chars`` long, to return with one
    name changed (what prompt lookup drafts for: the answer copies the prompt's code)."""
    queries: list[Query] = []
    seen: set[str] = set()
    for name, node, body in _functions(min_chars, max_chars):
        if name in seen:
            continue
        seen.add(name)
        ask = f"Rename the function below to `renamed` and return the whole code, otherwise unchanged:\n\n```python\n{body}\n```"
        queries.append(Query(f"stdlib-edit/{name}.{node.name}", "edit", "stdlib", messages=({"role": "user", "content": ask},)))
        if len(queries) == n:
            return queries
    raise MissingDataError(f"only {len(queries)} functions to edit found in the standard library, {n} asked")


def _functions(min_chars: int, max_chars: int):
    """(module, node, source) of every function of :data:`STDLIB_MODULES` ``min_chars``-``max_chars`` long, in order."""
    import ast
    import importlib
    import inspect

    for name in STDLIB_MODULES:
        try:
            source = inspect.getsource(importlib.import_module(name))
        except (ImportError, OSError, TypeError):  # a module this Python lacks (or ships compiled only)
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = ast.get_source_segment(source, node, padded=True) or ""
                if min_chars <= len(body) <= max_chars:
                    yield name, node, body


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
