"""Tool calls: OpenAI's ``tools`` and ``tool_choice``, in the format the model's chat template speaks.

A format (:class:`ToolFormat`, named as vLLM's ``--tool-call-parser``) says four things: how the
offered tools reach the prompt, how an assistant's earlier calls are written back into the
conversation, the grammar of a call (for ``tool_choice: "required"`` or a named function, enforced
by :class:`~onlinespec.decoding.grammar.Constraint` on the target's distribution) and how a call is
read back from what the model wrote (``auto``).

- ``hermes``: the template renders ``tools`` itself and the model writes each call as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Hermes 2 and 3, and
  the many templates that copy them). An assistant's calls go to the template as ``tool_calls``
  with their arguments as objects; ``role: "tool"`` messages go as they are. A free answer may
  hold several calls, one block each.
- ``generic``, for a template with no tool format (the packaged default's): a system message lists
  the tools (name, description, parameter schema, one JSON object a line) and asks for a bare
  ``{"name": ..., "arguments": {...}}``; earlier calls are written back in that form.

In both, a required or named call is one call: the grammar ends the answer after it (allowing
more let the 1.5B repeat the same call until ``max_tokens``). Several calls come from ``auto``,
where the model writes them itself; ``parallel_tool_calls: false`` keeps the first.

``auto`` (the server's default, ``--tool-call-parser``) picks ``hermes`` when the chat template
renders ``tools`` and writes ``<tool_call>``, else ``generic``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace

from onlinespec.decoding.grammar import Constraint
from onlinespec.safety import shown
from onlinespec.serve.handles import ServeError

MAX_TOOLS = 64
PARSERS = ("auto", "generic", "hermes")
GENERIC_SYSTEM = ("To call one of these tools, answer with only the JSON object {\"name\": <tool name>, \"arguments\": {...}}. "
                  "Tools:\n")
# the JSON of a hermes call as the template writes it (jinja's tojson: ", " and ": "), without free whitespace
HERMES_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True, "coerce_one_of": True}
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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


def _call_schema(functions: list[dict]) -> dict:
    """One call of one of ``functions``: ``{"name": <its name>, "arguments": <its parameters>}``."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _arguments(call: dict) -> tuple[str, object]:
    """An OpenAI ``tool_calls`` entry's name and arguments (parsed from their JSON text where they are text)."""
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass
    return function.get("name", ""), arguments


def _openai_call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _calls(found: list, functions: list[dict]) -> list[dict] | None:
    """``found`` (decoded JSON values) as OpenAI's ``tool_calls``, or None unless each is a call of one of ``functions``."""
    names = {f["name"] for f in functions}
    if not found or not all(isinstance(c, dict) and c.get("name") in names and isinstance(c.get("arguments", {}), dict) for c in found):
        return None
    return [_openai_call(c["name"], c.get("arguments", {})) for c in found]


@dataclass(frozen=True)
class ToolFormat:
    """The generic format (see the module docstring); :class:`HermesTools` is the template's own."""

    name: str = "generic"

    def prompt(self, messages: list[dict], functions: list[dict]) -> tuple[list[dict], dict]:
        """The conversation with the tools offered, and the template variables that carry them."""
        described = GENERIC_SYSTEM + "\n".join(json.dumps({k: v for k, v in f.items() if v != ""}, separators=(",", ":")) for f in functions)
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + described}, *messages[1:]], {}
        return [{"role": "system", "content": described}, *messages], {}

    def message(self, role: str, content: str, tool_calls: list | None) -> dict:
        """A message as the template is given it; an assistant's earlier calls written as the model would have."""
        if tool_calls:
            written = [json.dumps({"name": name, "arguments": arguments}) for name, arguments in map(_arguments, tool_calls)]
            content = (content + "\n" + "\n".join(written)).strip()
        return {"role": role, "content": content}

    def constraint(self, functions: list[dict]) -> Constraint:
        """The grammar of an answer that is one call of one of ``functions``."""
        return replace(Constraint.json_schema(_call_schema(functions)), source="tools")

    def parse(self, text: str, functions: list[dict]) -> tuple[str | None, list[dict]] | None:
        """(the answer's content, its calls) when ``text`` calls one of ``functions``, else None:
        one JSON object per line, or a list of them, optionally in ``<tool_call>`` tags or a code fence."""
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
        calls = _calls(found, functions)
        return (None, calls) if calls else None


@dataclass(frozen=True)
class HermesTools(ToolFormat):
    """Calls in ``<tool_call>`` blocks, tools rendered by the template (see the module docstring).
    ``tags``: the grammar's terms for the opening and closing tags: the tokens themselves where the
    tokenizer has them as single tokens (Qwen2.5's 151657 and 151658, as the model writes them),
    else the text."""

    name: str = "hermes"
    tags: tuple[str, str] = ('"<tool_call>"', '"</tool_call>"')

    def prompt(self, messages: list[dict], functions: list[dict]) -> tuple[list[dict], dict]:
        return messages, {"tools": [{"type": "function", "function": f} for f in functions]}

    def message(self, role: str, content: str, tool_calls: list | None) -> dict:
        if not tool_calls:
            return {"role": role, "content": content}
        calls = [{"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in map(_arguments, tool_calls)]
        return {"role": role, "content": content, "tool_calls": calls}

    def constraint(self, functions: list[dict]) -> Constraint:
        schema = {**_call_schema(functions), "x-guidance": HERMES_JSON}
        grammar = f'start: {self.tags[0]} "\\n" call "\\n" {self.tags[1]}\ncall: %json {json.dumps(schema)}\n'
        return replace(Constraint("grammar", grammar), source="tools")

    def parse(self, text: str, functions: list[dict]) -> tuple[str | None, list[dict]] | None:
        """The calls in ``<tool_call>`` blocks (None when one is not a call of ``functions``); the
        text outside them is the answer's content (None when blank), as vLLM's hermes parser
        keeps it. An answer with no block is read as the generic format reads it: left free,
        Qwen2.5-Coder-1.5B wrote its calls as a fenced JSON object on 5 of 5 prompts that asked
        for a tool (2026-12-07)."""
        blocks = HERMES_BLOCK.findall(text)
        if not blocks:
            return super().parse(text, functions)
        try:
            calls = _calls([json.loads(block) for block in blocks], functions)
        except ValueError:
            return None
        content = HERMES_BLOCK.sub("", text).strip()
        return (content or None, calls) if calls else None


GENERIC, HERMES = ToolFormat(), HermesTools()


def parser_name(parser: str) -> str:
    """``parser`` when it names a format (or ``auto``); a ValueError naming the choices otherwise."""
    if parser not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}: use one of {', '.join(PARSERS)}")
    return parser


def tool_format(tokenizer, parser: str = "auto") -> ToolFormat:
    """The format ``parser`` names for ``tokenizer`` (its chat template and tags); ``auto``:
    hermes for a template that renders ``tools`` and writes ``<tool_call>``, else :data:`GENERIC`."""
    if parser_name(parser) == "auto":
        template = str(getattr(tokenizer, "chat_template", None) or "")  # a tokenizer may keep several named templates (a dict)
        parser = "hermes" if "<tool_call>" in template and re.search(r"\btools\b", template) else "generic"
    if parser == "generic":
        return GENERIC
    ids = [tokenizer.convert_tokens_to_ids(tag) for tag in ("<tool_call>", "</tool_call>")] if tokenizer is not None else []
    if ids and all(isinstance(i, int) and i != tokenizer.unk_token_id for i in ids):
        return HermesTools(tags=(f"<[{ids[0]}]>", f"<[{ids[1]}]>"))
    return HERMES
