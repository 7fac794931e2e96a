"""What being online costs serving itself, with no learner running: the verification trace (the
target's top-K and features at every verified row), building the training records, and writing
them durably to the replay buffer (temp file, fsync, rename).

Serves rounds of N online-split prompts (chat, code, maths; 48 new tokens) with the default
hybrid, ``--in-flight`` at a time, each round twice in the same process: plain (no trace), and
online (traced, then the records built and written, as the server's recorder does), alternating
which goes first. Prints the tokens/s of each and the median per-round ratio.

    python bench/online_overhead.py                                # llama.cpp (the default backend), 8 in flight
    python bench/online_overhead.py --backend torch --in-flight 1  # the earlier measurement's setting
"""

import argparse
import statistics
import tempfile
import time

from onlinespec.data.sources import packaged_prompts
from onlinespec.decoding.engine import DEFAULT_K
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.factory import DEFAULT_DRAFT, engine_options, make_proposer, new_decoder
from onlinespec.models import load_target
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.recorder import records_from_generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=16, help="requests per round")
    args = parser.parse_args()
    target = load_target("default", backend=args.backend, device="cpu")
    options = engine_options(target, DEFAULT_K, adaptive=True, kernels=True, max_batch=args.in_flight)
    proposer = make_proposer(DEFAULT_DRAFT, target, "float32").proposer
    decoder = new_decoder(target, proposer, DEFAULT_K, options, args.in_flight)
    buffer = ReplayBuffer(tempfile.mkdtemp(), "window", max_records=100_000)
    params = SamplingParams(max_new_tokens=48)
    queries = packaged_prompts(args.rounds * args.per_round, ("chat", "code", "math"), seed=3, split="online")
    decoder.generate_many([list(q.messages) if q.messages else q.prompt for q in queries[:2]], SamplingParams(max_new_tokens=4))  # warm-up
    speed: dict[str, list[float]] = {"plain": [], "online": []}
    trace_s, records_s, buffer_s = [], [], []
    for r in range(args.rounds):
        chunk = queries[r * args.per_round:(r + 1) * args.per_round]
        prompts = [list(q.messages) if q.messages else q.prompt for q in chunk]
        for mode in ("plain", "online")[:: 1 if r % 2 == 0 else -1]:
            tick = time.perf_counter()
            outs = decoder.generate_many(prompts, params, trace=mode == "online")
            serving = time.perf_counter() - tick
            if mode == "online":
                tick = time.perf_counter()
                records = [rec for q, out in zip(chunk, outs) for rec in records_from_generation(out, "verified", "teacher", q.domain, q.id)]
                built = time.perf_counter() - tick
                tick = time.perf_counter()
                for record in records:
                    buffer.add(record)
                written = time.perf_counter() - tick
                trace_s.append(serving)
                records_s.append(built)
                buffer_s.append(written)
                serving += built + written
            speed[mode].append(sum(len(o.token_ids) for o in outs) / serving)
        print(f"round {r + 1}/{args.rounds}: plain {speed['plain'][-1]:.1f} tok/s, online {speed['online'][-1]:.1f} tok/s", flush=True)
    ratio = statistics.median(o / p for o, p in zip(speed["online"], speed["plain"]))
    print(f"{target.backend}, {args.in_flight} in flight, {args.rounds} rounds of {args.per_round} requests, 48 new tokens, "
          f"default hybrid: plain {statistics.median(speed['plain']):.1f} tok/s, online {statistics.median(speed['online']):.1f} "
          f"tok/s (medians); median per-round ratio online/plain {ratio:.3f}")
    print(f"per round (medians): serving traced {statistics.median(trace_s):.2f} s, building records "
          f"{statistics.median(records_s) * 1e3:.0f} ms, durable buffer writes {statistics.median(buffer_s) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
