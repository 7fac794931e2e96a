"""Structured output and tool calls at the server: the request fields of both dialects, mapped to
one mechanism, a :class:`~onlinespec.decoding.grammar.Constraint` on the target's distribution
(docs/serve.md's field table, docs/engine.md for how it meets speculation).

Fields (at most one of them per request; two is a 400):

- OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": ...}}``;
- vLLM: ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and the newer
  ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``);
- llama-server: ``json_schema`` and ``grammar`` (GBNF, or Lark).

Tool calls (``tools``, ``tool_choice``): :mod:`onlinespec.serve.tools`, whose required calls are
constraints of this kind too.
"""

from __future__ import annotations

from dataclasses import replace

from onlinespec.decoding.grammar import Constraint, GrammarError, compile_constraint
from onlinespec.safety import shown
from onlinespec.serve.handles import ServeError

# the request fields (besides OpenAI's response_format) that ask for a constraint
STRUCTURED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "json_schema", "grammar")


def constraint_of(body) -> Constraint | None:
    """The one constraint a request's fields ask for (None: free output); a 400 naming the field otherwise."""
    asked = []
    fmt = body.response_format or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        asked.append(("response_format", Constraint("json_object", source="response_format")))
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ServeError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}", param="response_format")
        asked.append(("response_format", _build(Constraint.json_schema, spec["schema"], "response_format")))
    elif kind != "text":
        raise ServeError(f"response_format type {shown(kind)}: use text, json_object or json_schema", param="response_format")
    extra = body.model_extra or {}
    builds = (Constraint.json_schema, _regex, Constraint.choice, _grammar, None, Constraint.json_schema, _grammar)
    for field, build in zip(STRUCTURED_FIELDS, builds):
        if build is None:
            continue
        if extra.get(field) is not None:  # an empty choice or schema is a mistake to name, not "no constraint"
            asked.append((field, _build(build, extra[field], field)))
    if extra.get("structured_outputs") is not None:
        asked.append(("structured_outputs", _structured_outputs(extra["structured_outputs"])))
    if len(asked) > 1:
        raise ServeError(f"{' and '.join(f for f, _ in asked)} each constrain the output: send one", param=asked[1][0])
    return asked[0][1] if asked else None


def _structured_outputs(value) -> Constraint:
    """vLLM's ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``."""
    builds = {"json": Constraint.json_schema, "regex": _regex, "choice": Constraint.choice, "grammar": _grammar}
    if not isinstance(value, dict):
        raise ServeError("structured_outputs is an object, e.g. {\"json\": {...}} or {\"regex\": \"...\"}", param="structured_outputs")
    given = [k for k, v in value.items() if v not in (None, False, "", [], {}) and k in (*builds, "json_object")]
    if len(given) != 1:
        raise ServeError(f"structured_outputs: give exactly one of {', '.join([*builds, 'json_object'])}", param="structured_outputs")
    key = given[0]
    if key == "json_object":
        return Constraint("json_object", source="structured_outputs.json_object")
    return _build(builds[key], value[key], f"structured_outputs.{key}")


def _regex(value) -> Constraint:
    if not isinstance(value, str):
        raise GrammarError("a regex is a string")
    return Constraint("regex", value)


def _grammar(value) -> Constraint:
    if not isinstance(value, str):
        raise GrammarError("a grammar is a string (Lark or GBNF)")
    return Constraint("grammar", value)


def _build(build, value, field: str) -> Constraint:
    try:
        return replace(build(value), source=field)
    except GrammarError as err:
        raise ServeError(f"{field}: {err}", param=field, code="invalid_constraint") from None


def check(constraint: Constraint | None, tokenizer, eos_token_ids) -> None:
    """Compile ``constraint`` now (cached for the request itself): a 400 on the field that asked for it, saying what is wrong."""
    if constraint is None:
        return
    field = constraint.source or "response_format"
    try:
        compile_constraint(constraint, tokenizer, eos_token_ids)
    except GrammarError as err:
        raise ServeError(f"{field}: {err}", param=field, code="invalid_constraint") from None
