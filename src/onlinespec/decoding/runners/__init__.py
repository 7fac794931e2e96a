"""The target's side of a step: what the engine asks of whichever library runs the target.

vLLM calls this the model runner. The engine (:mod:`onlinespec.decoding.engine`) owns the
method: drafting, verification, sampling, traces. A runner owns the target's weights and its KV
cache, and answers three questions about a batch of requests, each keyed by its request object:

- ``prefill(request, tokens)``: a chunk of a prompt that is not the last one (no output);
- ``forward_alone(request, block, keep)``: a request's last prompt chunk and its first proposals
  in a forward of its own, the logits and post-norm hidden states of its last ``keep`` positions;
  ``join(request, length)`` then keeps its first ``length`` positions and adds it to the batch;
  ``fork(donor, request, length)`` may instead start a request's cache with the first ``length``
  positions of another's that holds the same prompt (``n`` choices of one prompt), or say False;
- ``forward(blocks)``: ONE forward over one block per running request (``rows`` order), the
  logits and hidden states of every block position; ``commit(kept)`` keeps each row's first
  ``kept[b]`` positions and forgets the rest (rejected proposals). An empty block is a row that
  sits the step out (``kept[b]`` 0): its cache stays as it was.

``release(requests)`` frees what a request holds (finished, cancelled, or failed half-way),
``rewind()`` forgets the last ``forward`` entirely (calibration), ``reset()`` drops everything.
Logits come back as float32 CPU tensors whatever the backend, so verification, the recorder and
the learner above never know which backend served.

Two backends: :class:`~onlinespec.decoding.runners.torch_runner.TorchRunner` (Hugging Face
models in PyTorch, CPU or CUDA, the reference in tests) and
:class:`~onlinespec.decoding.runners.llamacpp.LlamaCppRunner` (a GGUF file as shipped, run by
llama.cpp: the default for GGUF targets on a CPU). ``docs/backends.md`` says how they compare.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TargetRunner(Protocol):
    name: str  # "torch" or "llama.cpp": the calibration cache and the reports name the backend
    idle_rows_free: bool  # a row given an empty block in ``forward`` costs it nothing (it sits the step out)

    @property
    def context(self) -> int:
        """The most positions one request may reach (prompt, output and a verification block)."""

    @property
    def vocab_size(self) -> int:
        """Logit rows' length."""

    @property
    def rows(self) -> list[object]:
        """The requests in the batch, in the order ``forward`` takes their blocks."""

    @property
    def columns(self) -> int:
        """Cache columns a batched forward attends over now (what its cost grows with)."""

    def holding(self) -> list[object]:
        """Every request the runner keeps state for: the batch's and those still prefilling."""

    def prefill(self, request: object, tokens: list[int]) -> None: ...

    def forward_alone(self, request: object, block: list[int], keep: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def fork(self, donor: object, request: object, length: int) -> bool: ...

    def join(self, request: object, length: int) -> None: ...

    def forward(self, blocks: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]: ...

    def commit(self, kept: list[int]) -> None: ...

    def rewind(self) -> None: ...

    def release(self, requests: list[object]) -> None: ...

    def reset(self) -> None: ...
