"""--max-model-len caps the context a core serves: what /v1/models and /tokenize report, and the
limit past which a request is refused with the usual clear error; a cap past the model's own
context is refused at load. (In process, on the tiny target: no server to start.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore
from onlinespec.serve.handles import LoadFailed, ServeError


def config(target, max_model_len: int) -> CoreConfig:
    return CoreConfig(target=str(target), draft="ngram", k=2, kernels=False, adaptive_k=False, learn=False, max_model_len=max_model_len)


def test_max_model_len_caps_the_context_and_refuses_past_it(tiny_target_folder, tmp_path):
    core = ServingCore(config(tiny_target_folder, 64), tmp_path / "run")
    core.load()
    try:
        assert core.context == 64
        with pytest.raises(ServeError) as refused:
            core.submit(list(range(5, 5 + 62)), SamplingParams(max_new_tokens=1))
        assert refused.value.code == "context_length_exceeded" and "64 tokens" in refused.value.message
        assert core.submit(list(range(5, 15)), SamplingParams(max_new_tokens=4)) is not None
    finally:
        core.shutdown(drain_seconds=5)
    too_long = ServingCore(config(tiny_target_folder, 100_000), tmp_path / "run2")
    with pytest.raises(LoadFailed, match="--max-model-len 100000 is past this model's context of 256"):
        too_long.load()
    too_long.shutdown(drain_seconds=1)


@pytest.fixture
def base_model_folder(tiny_target_folder, tmp_path):
    """The tiny target as a base model ships: a tokenizer with no chat template."""
    import json
    import shutil

    folder = shutil.copytree(tiny_target_folder, tmp_path / "base-model")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


def test_a_model_without_a_chat_template_refuses_chat_clearly_and_serves_one_given(base_model_folder, tmp_path):
    messages = [{"role": "user", "content": "Hello there"}]
    bare = ServingCore(config(base_model_folder, 128), tmp_path / "bare")
    bare.load()
    try:
        with pytest.raises(ServeError) as refused:
            bare.submit(messages, SamplingParams(max_new_tokens=2))
        assert refused.value.param == "messages" and "--chat-template" in refused.value.message
        assert bare.submit("Hello there", SamplingParams(max_new_tokens=2)).result().token_ids  # text prompts still serve
    finally:
        bare.shutdown(drain_seconds=5)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    given = ServingCore(replace(config(base_model_folder, 128), chat_template=template), tmp_path / "given")
    given.load()
    try:
        handle = given.submit(messages, SamplingParams(max_new_tokens=2))
        assert handle.state.prompt_ids == given.tokenizer("<user>Hello there\n<assistant>").input_ids
        assert handle.result().token_ids
    finally:
        given.shutdown(drain_seconds=5)


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    from onlinespec.cli.serving import read_chat_template, vllm_options

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "t.jinja")) == template == read_chat_template(template)
    assert vllm_options(CoreConfig(), None, [], None, str(tmp_path / "t.jinja")).chat_template == template  # `serve --chat-template`
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
