"""Structured output and tool calls at the server: the request fields of both dialects, mapped to
one mechanism, a :class:`~onlinespec.decoding.grammar.Constraint` on the target's distribution
(docs/serve.md's field table, docs/engine.md for how it meets speculation).

Fields (at most one of them per request; two is a 400):

- OpenAI: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": ...}}``;
- vLLM: ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and the newer
  ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``);
- llama-server: ``json_schema`` and ``grammar`` (GBNF, or Lark).

Tool calls (chat): the default model's template has no tool format, so tools are described in a
system message of this module's generic format (:func:`tool_messages`): the model calls a tool by
answering ``{"name": ..., "arguments": {...}}``. ``tool_choice`` ``required`` or a named
function constrains the answer to that shape with the tools' own parameter schemas; ``auto``
leaves the model free and :func:`parse_tool_calls` reads a call from what it wrote; ``none``
describes no tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace

from onlinespec.decoding.grammar import Constraint, GrammarError, compile_constraint
from onlinespec.safety import shown
from onlinespec.serve.handles import ServeError

MAX_TOOLS = 64
# the request fields (besides OpenAI's response_format) that ask for a constraint
STRUCTURED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "json_schema", "grammar")
TOOL_SYSTEM = ("To call one of these tools, answer with only the JSON object {\"name\": <tool name>, \"arguments\": {...}}. "
               "Tools:\n")


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


# ---- tool calls --------------------------------------------------------------------------------

def tool_functions(tools: list | None) -> list[dict]:
    """The functions of OpenAI's ``tools`` (``[{"type": "function", "function": {"name", "description", "parameters"}}]``)."""
    functions = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ServeError(f"tools[{i}]: give {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}",
                             param=f"tools.{i}")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise ServeError(f"tools[{i}].function.parameters is a JSON schema (an object)", param=f"tools.{i}.function.parameters")
        functions.append({"name": function["name"], "description": function.get("description", ""), "parameters": parameters})
    if len(functions) > MAX_TOOLS:
        raise ServeError(f"at most {MAX_TOOLS} tools per request", param="tools")
    return functions


def chosen_tools(functions: list[dict], tool_choice) -> tuple[str, list[dict]]:
    """(``none`` | ``auto`` | ``required``, the functions it may call); a named function is ``required`` of that one."""
    if tool_choice is None:
        return ("auto" if functions else "none"), functions
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ServeError(f"tool_choice {shown(tool_choice)}: use none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                             param="tool_choice")
        if tool_choice != "none" and not functions:
            raise ServeError(f"tool_choice {tool_choice} needs tools", param="tool_choice")
        return tool_choice, functions
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise ServeError(f"tool_choice names function {shown(name)}, which is not in tools", param="tool_choice")
    return "required", named


def tool_constraint(functions: list[dict]) -> Constraint:
    """The answer is one call of one of ``functions``: ``{"name": <its name>, "arguments": <its parameters>}``."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return replace(Constraint.json_schema(calls[0] if len(calls) == 1 else {"anyOf": calls}), source="tools")


def tool_messages(messages: list[dict], functions: list[dict]) -> list[dict]:
    """The conversation with the tools described in its system message (the generic format)."""
    described = TOOL_SYSTEM + "\n".join(json.dumps({k: v for k, v in f.items() if v != ""}, separators=(",", ":")) for f in functions)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + described}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


def call_text(tool_calls: list) -> str:
    """An assistant message's ``tool_calls`` as the model would have written them (the generic format)."""
    written = []
    for call in tool_calls or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        written.append(json.dumps({"name": function.get("name", ""), "arguments": arguments}))
    return "\n".join(written)


def parse_tool_calls(text: str, functions: list[dict]) -> list[dict] | None:
    """The calls ``text`` makes (OpenAI's ``tool_calls``), or None when it is not a call of one of
    ``functions``: one JSON object per line, or a list of them, optionally in ``<tool_call>`` tags or a code fence."""
    names = {f["name"] for f in functions}
    body = text.strip().removeprefix("<tool_call>").removesuffix("</tool_call>").strip()
    body = body.removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        found = json.loads(body)
        found = found if isinstance(found, list) else [found]
    except ValueError:
        try:
            found = [json.loads(line) for line in body.splitlines() if line.strip()]
        except ValueError:
            return None
    calls = []
    for call in found:
        if not (isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict)):
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    return calls or None
