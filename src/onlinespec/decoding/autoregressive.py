"""The baseline: the target alone, one token per forward pass, with the same sampling API.

It is the speculative loop with no proposer, so sampling, stopping and accounting are the very
same code: any difference in output between the two is the proposer's doing, never the loop's.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from onlinespec.decoding.speculative import SpeculativeDecoder


def autoregressive_decoder(target: PreTrainedModel, tokenizer=None) -> SpeculativeDecoder:
    """A decoder that runs ``target`` alone (KV-cached, one token per step)."""
    return SpeculativeDecoder(target, tokenizer, proposer=None, k=0)
