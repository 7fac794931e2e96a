"""Tool calls in the chat template's own format (hermes: Qwen2.5, Hermes), docs/serve.md.

The template below is written here in the hermes shape (tools rendered by the template, calls in
``<tool_call>`` blocks, results in ``<tool_response>``), so that the tiny random target can serve
it: what these check is that a request's tools reach the prompt the way the template writes them,
that a required call comes back in that format as OpenAI's ``tool_calls``, and how a free answer is
read. Qwen2.5-Coder's own template through a real server: bench/tool_calls.py, docs/serve.md.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pytest

from onlinespec.serve.prompts import render
from onlinespec.serve.protocol import ChatRequest, parse
from onlinespec.serve.tools import GENERIC, HERMES, tool_format

HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call functions. Signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nReturn each call as <tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n"
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- for call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + call.function.name + '\\\", \\\"arguments\\\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next three days?"}]
CALLED = [*ASK, {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}}]},
          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def hermes_tokenizer(default_tokenizer, tags: bool = False):
    """The packaged tokenizer with the hermes template (and, with ``tags``, ``<tool_call>`` and ``</tool_call>`` as tokens of their own)."""
    tokenizer = copy.deepcopy(default_tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    if tags:
        tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    return tokenizer


def test_the_format_follows_the_chat_template_unless_named(default_tokenizer):
    assert tool_format(hermes_tokenizer(default_tokenizer)) == HERMES
    assert tool_format(default_tokenizer) is GENERIC  # the packaged model's template has no tool format
    assert tool_format(hermes_tokenizer(default_tokenizer), "generic") is GENERIC and tool_format(default_tokenizer, "hermes") == HERMES
    with pytest.raises(ValueError, match="auto, generic, hermes"):
        tool_format(default_tokenizer, "mistral")


def test_a_required_call_writes_the_tags_as_the_tokens_the_model_has_for_them(default_tokenizer):
    """Qwen2.5's tokenizer has <tool_call> as one token (151657), and the model writes that token:
    a grammar of the tag's text would force its characters instead, off the model's own path."""
    from onlinespec.decoding.grammar import compile_constraint

    tokenizer = hermes_tokenizer(default_tokenizer, tags=True)
    tools = tool_format(tokenizer)
    matcher = compile_constraint(tools.constraint([TOOLS[1]["function"]]), tokenizer, [tokenizer.eos_token_id])
    written = tokenizer('<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>', add_special_tokens=False).input_ids
    assert written[0] == tokenizer.convert_tokens_to_ids("<tool_call>")
    assert matcher.validate_tokens(written) == len(written)


def test_tools_and_earlier_calls_are_rendered_by_a_hermes_template(default_tokenizer):
    tokenizer = hermes_tokenizer(default_tokenizer)
    body = parse(json.dumps({"model": "m", "messages": CALLED, "tools": TOOLS}).encode(), ChatRequest)
    text = tokenizer.decode(render(tokenizer, body.use_tools(HERMES).prompt()))
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    # the earlier call's arguments go to the template as an object (OpenAI sends them as JSON text), the result as a tool response
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert "To call one of these tools" not in text  # the generic format's system message is not added


def test_a_hermes_answer_is_read_as_its_content_and_calls():
    functions = [t["function"] for t in TOOLS]
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>')
    content, calls = HERMES.parse(text, functions)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"city": "Oslo"})]
    assert HERMES.parse("It is sunny in Rome.", functions) is None
    fenced = '```json\n{\n  "name": "get_time",\n  "arguments": {\n    "city": "Rome"\n  }\n}\n```'  # as Qwen2.5-Coder-1.5B writes a call unasked
    assert [c["function"]["name"] for c in HERMES.parse(fenced, functions)[1]] == ["get_time"]
    assert HERMES.parse('<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>', functions) is None  # not offered
    assert HERMES.parse("<tool_call>\n{not json\n</tool_call>", functions) is None


@pytest.fixture(scope="module")
def hermes_server(tiny_target_folder, tmp_path_factory):
    from tests.serve.conftest import start_server

    out_dir = tmp_path_factory.mktemp("hermes") / "run"
    template = out_dir.parent / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    process = start_server(tiny_target_folder, out_dir, "--chat-template", str(template))
    yield process
    process.stop()


def test_a_required_call_is_served_in_the_templates_format(hermes_server):
    import httpx

    api = openai.OpenAI(base_url=hermes_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = api.models.list().data[0].id
    # the prompt a chat request is served from is the one /tokenize renders: the tools inside the template's <tools>
    tokenized = httpx.post(hermes_server.url + "/tokenize", json={"messages": CALLED, "tools": TOOLS}, timeout=30).json()
    prompt = httpx.post(hermes_server.url + "/detokenize", json={"tokens": tokenized["tokens"]}, timeout=30).json()["prompt"]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in prompt
    asked = httpx.post(hermes_server.url + "/tokenize", json={"messages": ASK, "tools": TOOLS[:1]}, timeout=30).json()["count"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS[:1], tool_choice=named, temperature=0, max_tokens=48,
                                         extra_body={"parallel_tool_calls": False})
    assert answer.usage.prompt_tokens == asked  # the chat was served from that rendering
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = api.chat.completions.create(model=model, messages=ASK, tools=TOOLS[1:], tool_choice="required", temperature=0, max_tokens=48,
                                         stream=True, extra_body={"parallel_tool_calls": False})
    names, arguments, finish = [], "", None
    for chunk in stream:
        for delta in chunk.choices:
            names += [c.function.name for c in delta.delta.tool_calls or [] if c.function.name]
            arguments += "".join(c.function.arguments or "" for c in delta.delta.tool_calls or [])
            finish = delta.finish_reason or finish
    assert finish == "tool_calls" and names == ["get_time"]
    jsonschema.validate(json.loads(arguments), TIME)


def test_parallel_tool_calls_false_answers_with_the_first_call_only():
    from onlinespec.decoding.request import RequestStats
    from onlinespec.serve.handles import Served
    from onlinespec.serve.shapes import Shape

    text = ('<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>')
    served = Served("r", text, [], 1, "stop", RequestStats(), "d", None, [], "default", False, False)
    functions = [t["function"] for t in TOOLS]
    both = Shape(True, "c", 0, "m", tools=functions, tool_format=HERMES).response([served])["choices"][0]["message"]["tool_calls"]
    first = Shape(True, "c", 0, "m", tools=functions, tool_format=HERMES, parallel_tool_calls=False).response([served])
    assert len(both) == 2 and [json.loads(c["function"]["arguments"]) for c in first["choices"][0]["message"]["tool_calls"]] == [{"city": "Rome"}]
