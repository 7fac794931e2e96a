"""--max-model-len caps the context a core serves: what /v1/models and /tokenize report, and the
limit past which a request is refused with the usual clear error; a cap past the model's own
context is refused at load. (In process, on the tiny target: no server to start.)"""

from __future__ import annotations

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
            core.submit(list(range(5, 5 + 62)), SamplingParams(), max_tokens=1)
        assert refused.value.code == "context_length_exceeded" and "64 tokens" in refused.value.message
        assert core.submit(list(range(5, 15)), SamplingParams(), max_tokens=4) is not None
    finally:
        core.shutdown(drain_seconds=5)
    too_long = ServingCore(config(tiny_target_folder, 100_000), tmp_path / "run2")
    with pytest.raises(LoadFailed, match="--max-model-len 100000 is past this model's context of 256"):
        too_long.load()
    too_long.shutdown(drain_seconds=1)
