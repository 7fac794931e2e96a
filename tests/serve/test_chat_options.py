"""vLLM's rendering options reach the prompt, through a real server and the real openai client:
``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` (the server's
template uses a variable), ``add_special_tokens``, chat's ``echo``; what is not implemented
(a per-request ``chat_template``) or malformed (a ``response_format`` of no known type) is a 400 naming the field, and
a malformed option a 4xx, never a 200 that ignored it."""

from __future__ import annotations

import json
import pickle

import httpx
import openai
import pytest

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.serve.prompts import ChatPrompt, TextPrompt, render
from tests.serve.conftest import start_server

# the default tokenizer's ChatML, with a variable that changes the rendered prompt
TEMPLATE = ("{% if shout %}LOUD PROMPT {% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' "
            "+ message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "user", "content": "Name a colour."}]
STARTED = "The colour is"
CONTINUE = [*MESSAGES, {"role": "assistant", "content": STARTED}]


@pytest.fixture(scope="module")
def templated(tiny_target_folder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("templated")
    (folder / "template.jinja").write_text(TEMPLATE)
    process = start_server(tiny_target_folder, folder / "run", "--chat-template", str(folder / "template.jinja"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def chat(templated):
    client = openai.OpenAI(base_url=templated.url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id

    def ask(messages=MESSAGES, **extra):
        response = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                                    extra_body=extra or None)
        assert "x-ignored-fields" not in response.headers, response.headers["x-ignored-fields"]
        return response.parse()

    ask.model = model
    return ask


def tokenize(server, **body) -> dict:
    response = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_rendering_options_change_the_prompt_as_tokenize_renders_it(templated, chat, alone):
    base = chat().usage.prompt_tokens
    assert base == tokenize(templated, messages=MESSAGES)["count"]
    bare = chat(add_generation_prompt=False)
    assert bare.usage.prompt_tokens == tokenize(templated, messages=MESSAGES, add_generation_prompt=False)["count"] < base
    assert bare.choices[0].message.role == "user"  # vLLM's: without a generation prompt the answer goes on the last message's role
    loud = chat(chat_template_kwargs={"shout": True, "unused": None})
    assert loud.usage.prompt_tokens == tokenize(templated, messages=MESSAGES, chat_template_kwargs={"shout": True})["count"] > base
    assert chat(chat_template_kwargs={"shout": False}).usage.prompt_tokens == base
    assert chat(add_special_tokens=True).usage.prompt_tokens >= base  # this tokenizer has no BOS to add: accepted all the same


def test_continue_final_message_continues_it_and_echo_puts_it_first(templated, chat, alone):
    options = {"continue_final_message": True, "add_generation_prompt": False}
    ids = tokenize(templated, messages=CONTINUE, **options)["tokens"]
    assert alone.tokenizer.decode(ids).endswith(f"assistant\n{STARTED}"), "the last message is left open"
    got = chat(CONTINUE, **options)
    want = alone.generate(ids, SamplingParams(max_new_tokens=6)).text  # greedy: the target alone, from exactly that prompt
    assert got.usage.prompt_tokens == len(ids) and got.choices[0].message.content == want
    echoed = chat(CONTINUE, echo=True, **options)
    assert echoed.choices[0].message.role == "assistant" and echoed.choices[0].message.content == STARTED + want
    assert chat(echo=True).choices[0].message.content == chat().choices[0].message.content  # a user's message is not the answer's
    stream = httpx.post(templated.url + "/v1/chat/completions", timeout=60, json={
        "model": chat.model, "messages": CONTINUE, "max_tokens": 6, "temperature": 0, "stream": True, "echo": True, **options})
    chunks = [json.loads(line.removeprefix("data: ")) for line in stream.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == STARTED + want


@pytest.mark.parametrize(("path", "extra", "status", "param"), [
    ("chat", {"messages": CONTINUE, "continue_final_message": True}, 400, "continue_final_message"),  # add_generation_prompt: true
    ("chat", {"continue_final_message": True, "add_generation_prompt": False}, 400, "continue_final_message"),  # a user's message
    ("chat", {"messages": CONTINUE}, 400, "messages"),
    ("chat", {"chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs.tokenize"),
    ("chat", {"chat_template_kwargs": {"shout": [1]}}, 422, "chat_template_kwargs.shout"),
    ("chat", {"chat_template_kwargs": {"not a name": 1}}, 422, "chat_template_kwargs"),
    ("chat", {"chat_template_kwargs": {f"v{i}": 1 for i in range(17)}}, 422, "chat_template_kwargs"),
    ("chat", {"chat_template_kwargs": {"shout": "x" * 1001}}, 422, "chat_template_kwargs.shout"),
    ("chat", {"chat_template_kwargs": "shout"}, 422, "chat_template_kwargs"),
    ("chat", {"chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("chat", {"response_format": {"type": "xml"}}, 400, "response_format"),
    ("completions", {"response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("completions", {"add_special_token": False}, 400, "add_special_token"),
    ("chat", {"add_generation_promt": False}, 400, "add_generation_promt"),
])
def test_what_is_not_served_as_asked_is_refused_naming_the_field(templated, chat, path, extra, status, param):
    body = {"model": chat.model, "max_tokens": 2, **({"messages": MESSAGES} if path == "chat" else {"prompt": "Hello"}), **extra}
    response = httpx.post(f"{templated.url}/v1/{'chat/completions' if path == 'chat' else 'completions'}", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    if param == "response_format":
        assert "json_schema" in response.json()["error"]["message"]


def test_completions_take_add_special_tokens_and_a_text_response_format(templated, chat):
    for extra in ({"add_special_tokens": False}, {"add_special_tokens": True}, {"response_format": {"type": "text"}}):
        response = httpx.post(templated.url + "/v1/completions", timeout=60,
                              json={"model": chat.model, "prompt": "Hello", "max_tokens": 2, "temperature": 0, **extra})
        assert response.status_code == 200 and "x-ignored-fields" not in response.headers, response.text


class RecordingTokenizer:
    """A tokenizer that says what it was asked (no model)."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append(("template", kwargs))
        return "rendered"

    def __call__(self, text, add_special_tokens=True):
        self.calls.append(("tokens", text, add_special_tokens))
        return type("Encoding", (), {"input_ids": [1, 2] if add_special_tokens else [2]})()


def test_render_passes_every_option_and_the_prompts_cross_processes_whole():
    tokenizer = RecordingTokenizer()
    assert render(tokenizer, TextPrompt("hi")) == [1, 2] and render(tokenizer, TextPrompt("hi", add_special_tokens=False)) == [2]
    chat = ChatPrompt(CONTINUE, add_generation_prompt=False, continue_final_message=True, add_special_tokens=True,
                      template_kwargs={"enable_thinking": False})
    assert render(tokenizer, chat) == [1, 2]
    assert tokenizer.calls[-2] == ("template", {"add_generation_prompt": False, "continue_final_message": True, "tokenize": False,
                                                "enable_thinking": False})
    assert tokenizer.calls[-1] == ("tokens", "rendered", True)
    for prompt in (chat, TextPrompt("hi", add_special_tokens=False)):  # a Ray replica gets them pickled
        again = pickle.loads(pickle.dumps(prompt))
        assert type(again) is type(prompt) and again == prompt and vars(again) == vars(prompt)
