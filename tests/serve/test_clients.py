"""Client libraries other than `openai` against a real server: lm-eval's OpenAI-compatible
completions model runs a small task (data in this file) of both kinds, and Hugging Face's
``InferenceClient`` chats, streaming or not. What they read must be the target alone's."""

from __future__ import annotations

import json

import pytest
import torch

from onlinespec.decoding.sampling import SamplingParams

CHOICE = [  # a loglikelihood task: lm-eval scores each choice after the question
    {"question": "The sky on a clear day is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Kelvin", " hours"], "answer": 0},
    {"question": "def add(a, b):\n    return", "choices": [" a + b", " a * b"], "answer": 0},
]
GENERATE = [  # a generate_until task: greedy text up to a newline
    {"question": "Q: Name a colour.\nA:", "answer": " red"},
    {"question": "Q: What is 3 + 4?\nA:", "answer": " 7"},
]
TASKS = """
task: onlinespec_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{choice}"}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list: [{{metric: acc}}]
---
task: onlinespec_generate
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{generate}"}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 12}}
metric_list: [{{metric: exact_match}}]
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, rows in (("choice", CHOICE), ("generate", GENERATE)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for text in TASKS.format(choice=folder / "choice.jsonl", generate=folder / "generate.jsonl").split("---"):
        name = text.split("task: ")[1].split()[0]
        (folder / f"{name}.yaml").write_text(text.strip() + "\n")
    return folder


def test_lm_eval_loglikelihood_and_generate_until_are_the_target_alones(server, model, alone, tasks, tiny_target_folder, monkeypatch):
    """lm-eval's ``local-completions`` on our server: every loglikelihood it computed equals one
    forward of the target alone over lm-eval's own tokens (1e-4), and every generation the
    target alone's greedy text."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tasks / "hf"))
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=model, tokenizer_backend="huggingface",
                             tokenizer=str(tiny_target_folder), num_concurrent=1, max_retries=1, tokenized_requests=True)
    results = lm_eval.simple_evaluate(model=lm, tasks=["onlinespec_choice", "onlinespec_generate"],
                                      task_manager=TaskManager(include_path=str(tasks)), log_samples=True, verbosity="ERROR")
    scored = [(args, resp) for sample in results["samples"]["onlinespec_choice"] for args, resp in zip(sample["arguments"], sample["resps"])]
    assert len(scored) == sum(len(row["choices"]) for row in CHOICE)
    for (context, continuation), [(logprob, greedy)] in scored:
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        ids = context_ids + continuation_ids
        with torch.inference_mode():
            rows = alone.target(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
        scores = rows[len(context_ids) - 1: -1].gather(1, torch.tensor(continuation_ids)[:, None])[:, 0]
        assert logprob == pytest.approx(float(scores.sum()), abs=1e-4), (context, continuation)
        assert greedy == all(int(rows[len(context_ids) - 1 + i].argmax()) == t for i, t in enumerate(continuation_ids))
    for sample in results["samples"]["onlinespec_generate"]:
        context = sample["arguments"][0][0]
        want = alone.generate(alone.tokenizer(context).input_ids, SamplingParams(max_new_tokens=12, stop_strings=("\n",))).text
        assert sample["resps"][0][0] == want.split("\n")[0]


def test_hugging_face_inference_client_chats_like_the_target_alone(server, model, alone):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=server.url + "/v1", api_key="none", timeout=60)
    messages = [{"role": "user", "content": "Name three primes."}]
    want = alone.generate(messages, SamplingParams(max_new_tokens=16))
    got = client.chat_completion(messages, model=model, max_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.text and got.usage.completion_tokens == len(want.token_ids)
    chunks = client.chat_completion(messages, model=model, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    top = client.chat_completion(messages, model=model, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert [c.logprob for c in top.choices[0].logprobs.content] == pytest.approx(
        [x.logprob for x in alone.generate(messages, SamplingParams(max_new_tokens=4, logprobs=2)).logprobs], abs=1e-4)
