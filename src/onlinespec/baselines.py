"""What users would run instead of onlinespec, run on the same prompt ids for side-by-side benchmarks
(:mod:`onlinespec.benchmark`): Hugging Face assisted generation (torch targets) and plain llama.cpp
(llama-cpp-python's own generation on a GGUF file, one token per decode)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.factory import DraftChoice
from onlinespec.models import LoadedModel


class HFAssisted:
    """Hugging Face assisted generation with the same draft and a constant k (no heuristics)."""

    def __init__(self, target: LoadedModel, choice: DraftChoice, k: int) -> None:
        self.target = target
        self.kwargs: dict = {}
        if choice.model is None:  # n-gram: HF's prompt lookup decoding
            self.kwargs = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 3}
        else:
            draft = choice.model.model
            draft.generation_config = target.model.generation_config.__class__.from_dict(
                target.model.generation_config.to_dict()
            )
            draft.generation_config.num_assistant_tokens = k
            draft.generation_config.num_assistant_tokens_schedule = "constant"
            draft.generation_config.assistant_confidence_threshold = 0.0
            self.kwargs = {"assistant_model": draft}

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], float]:
        ids = torch.tensor([prompt_ids])
        sampling = {"do_sample": False}
        if not params.greedy:
            torch.manual_seed(params.seed or 0)
            sampling = {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
        hf_logging.set_verbosity_error()  # HF warns about its own internal generation_config use
        start = time.perf_counter()
        out = self.target.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=params.max_new_tokens,
            pad_token_id=self.target.tokenizer.eos_token_id,
            **sampling,
            **self.kwargs,
        )
        seconds = time.perf_counter() - start
        return out[0, len(prompt_ids):].tolist(), seconds


class PlainLlamaCpp:
    """llama-cpp-python's ``create_completion`` on a GGUF file (what a llama.cpp user runs): greedy,
    repeat penalty off, the same token ids in. ``lookup``: with its prompt-lookup speculative
    decoding (``LlamaPromptLookupDecoding``), that many tokens drafted a round."""

    def __init__(self, gguf: Path, lookup: int | None = None, context: int = 4096) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from onlinespec.decoding.runners.llamacpp import cpu_threads

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        self.gguf = Path(gguf)
        self.llama = llama_cpp.Llama(str(gguf), n_ctx=context, n_batch=512, n_threads=cpu_threads(), n_threads_batch=cpu_threads(),
                                     draft_model=draft, verbose=False)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], float]:
        """(new token ids, seconds), greedy (a sampled request is decoded greedily too: llama.cpp's
        sampler is not ours, so only greedy outputs compare)."""
        import llama_cpp

        self.llama.reset()
        start = time.perf_counter()
        ids = []
        for token in self.llama.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(self.llama._model.vocab, token):  # as create_completion stops
                break
            ids.append(token)
            if len(ids) >= params.max_new_tokens:
                break
        return ids, time.perf_counter() - start
