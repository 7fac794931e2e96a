"""Structured output and tool calls through a real server and the `openai` client (docs/serve.md).

The tiny random target speaks no language: what these check is the mechanism, that whatever it
writes under a constraint matches it (every answer that ends by itself parses and validates), and
the API's shapes. The lossless claims are tests/decoding/test_structured.py's.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
RATING = {"type": "object", "properties": {"stars": {"enum": [1, 2, 3, 4, 5]}, "liked": {"type": "boolean"}},
          "required": ["stars", "liked"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "rate", "description": "Rate a film", "parameters": RATING}}]
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next three days?"}]


def chat(client, model, **kwargs):
    return client.chat.completions.create(model=model, messages=kwargs.pop("messages", ASK), max_tokens=kwargs.pop("max_tokens", 40), **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate(client, model, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    for seed in range(3):
        answer = chat(client, model, response_format=fmt, temperature=temperature, seed=seed).choices[0]
        assert answer.finish_reason in ("stop", "length")
        if answer.finish_reason == "stop":
            jsonschema.validate(json.loads(answer.message.content), WEATHER)


def test_each_dialects_field_constrains(client, model):
    choice = chat(client, model, extra_body={"guided_choice": ["alpha", "beta"]}).choices[0].message.content
    assert choice in ("alpha", "beta")
    regex = chat(client, model, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}).choices[0].message.content
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex)
    gbnf = chat(client, model, extra_body={"grammar": 'root ::= "yes" | "no"'}).choices[0].message.content  # llama-server's
    assert gbnf in ("yes", "no")
    text = client.completions.create(model=model, prompt="Weather:", max_tokens=40, temperature=0,
                                     extra_body={"guided_json": RATING}).choices[0]
    if text.finish_reason == "stop":
        jsonschema.validate(json.loads(text.text), RATING)
    obj = chat(client, model, response_format={"type": "json_object"}, max_tokens=60).choices[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)


@pytest.mark.parametrize("body, said", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "send one"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "exactly one"),
    ({"grammar": 'root ::= ("yes" | '}, "grammar"),
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}, "tools": TOOLS}, "not in tools"),
])
def test_a_bad_constraint_is_a_400_that_says_what(client, model, body, said):
    with pytest.raises(openai.BadRequestError, match=said):
        chat(client, model, extra_body=body)


def test_required_and_named_tool_calls_validate_and_a_tool_result_continues(client, model):
    for choice, schemas in (("required", {"get_weather": WEATHER, "rate": RATING}),
                            ({"type": "function", "function": {"name": "rate"}}, {"rate": RATING})):
        answer = chat(client, model, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=48).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        call = answer.message.tool_calls[0]
        assert call.type == "function" and call.function.name in schemas
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    after = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny"})}]
    answer = chat(client, model, messages=after, tools=TOOLS, max_tokens=8).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_calls_come_as_openai_sends_them(client, model):
    stream = chat(client, model, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0, max_tokens=48, stream=True)
    name, arguments, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                name += call.function.name or ""
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)
