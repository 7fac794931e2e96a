"""What being online costs serving itself, with no learner running: the verification trace (the
target's top-K and features at every verified row), building the training records, and writing
them durably to the replay buffer (temp file, fsync, rename).

Serves N online-split prompts (chat, code, maths; 48 new tokens) with the default hybrid, each
twice in the same process, with and without the trace, alternating which goes first.

    python bench/online_overhead.py [N]      # default 18 prompts: about a minute on 2 cores
"""
import statistics
import sys
import tempfile
import time

from onlinespec.data.sources import packaged_prompts
from onlinespec.decoding.engine import DEFAULT_K
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.decoding.speculative import SpeculativeDecoder
from onlinespec.factory import DEFAULT_DRAFT, engine_options, make_proposer
from onlinespec.models import load_model
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.recorder import records_from_generation


def main(n: int) -> None:
    target = load_model("default", "float32")
    options = engine_options(target, DEFAULT_K, adaptive=True, kernels=True)
    proposer = make_proposer(DEFAULT_DRAFT, target, "float32").proposer
    decoder = SpeculativeDecoder(target.model, target.tokenizer, proposer, k=DEFAULT_K, **options)
    buffer = ReplayBuffer(tempfile.mkdtemp(), "window", max_records=100_000)
    params = SamplingParams(max_new_tokens=48)
    speed: dict[str, list[float]] = {"plain": [], "traced": []}
    request_s, records_s, buffer_s = [], [], []
    for i, query in enumerate(packaged_prompts(n, ("chat", "code", "math"), seed=3, split="online")):
        prompt = list(query.messages) if query.messages else query.prompt
        for mode in ("plain", "traced")[:: 1 if i % 2 == 0 else -1]:
            tick = time.perf_counter()
            out = decoder.generate(prompt, params, trace=mode == "traced")
            seconds = time.perf_counter() - tick
            speed[mode].append(len(out.token_ids) / seconds)
            if mode == "traced":
                request_s.append(seconds)
                tick = time.perf_counter()
                records = records_from_generation(out, "verified", "teacher", query.domain, query.id)
                records_s.append(time.perf_counter() - tick)
                tick = time.perf_counter()
                for record in records:
                    buffer.add(record)
                buffer_s.append(time.perf_counter() - tick)
    ratio = statistics.median(t / p for t, p in zip(speed["traced"], speed["plain"]))
    print(f"{n} requests, 48 new tokens, default hybrid: plain {statistics.median(speed['plain']):.1f} tok/s, "
          f"traced {statistics.median(speed['traced']):.1f} tok/s (medians); median per-request ratio {ratio:.3f}")
    print(f"per request (medians): serving {statistics.median(request_s) * 1e3:.0f} ms, building records "
          f"{statistics.median(records_s) * 1e3:.1f} ms, durable buffer writes {statistics.median(buffer_s) * 1e3:.1f} ms")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 18)
