"""onlinespec: online speculative decoding (Liu et al., ICML 2024).

Lossless speculative decoding of a target LLM whose draft learns from live traffic. The main
entry points::

    from onlinespec import load_decoder, SamplingParams
    decoder = load_decoder(target="default", draft="ngram", k=4)
    out = decoder.generate("Once upon a time", SamplingParams(max_new_tokens=32))
"""

from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import Generation, RequestStats, RoundTrace, SpeculativeDecoder, StreamChunk
from onlinespec.factory import load_decoder, make_proposer

__all__ = [
    "Generation",
    "RequestStats",
    "RoundTrace",
    "SamplingParams",
    "SpeculativeDecoder",
    "StreamChunk",
    "load_decoder",
    "make_proposer",
]
