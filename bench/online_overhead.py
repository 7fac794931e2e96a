"""What being online costs serving itself, part by part, with no learner running.

- ``index``: the suffix index of earlier requests (every earlier round's prompts and verified
  outputs, as the server adds them), its proposals taken where the hybrid judges they pay;
- ``online``: the verification trace (the target's top-K and features at every verified row),
  building the training records, and writing them durably to the replay buffer (temp file,
  fsync, rename), as the server's recorder does.

Serves rounds of N new online-split prompts (48 new tokens, greedy) with the default hybrid,
``--in-flight`` at a time, each round once per mode in the same process, the order rotating by
round, against ``plain`` (no trace, an empty index): the machine's drift falls on every mode alike.
Each mode has acceptance statistics of its own, as each draft of a server does. Prints per round
and at the end the tokens/s of each mode, the median per-round ratio to plain, tokens per target
forward, and what each drafter proposed and got accepted.

    python bench/online_overhead.py                                  # llama.cpp (the default backend), 8 in flight
    python bench/online_overhead.py --modes plain,index --domains chat --rounds 12
    python bench/online_overhead.py --backend torch --in-flight 1    # the earlier measurement's setting
"""

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from onlinespec.data.sources import packaged_prompts
from onlinespec.decoding.engine import DEFAULT_K
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.factory import DEFAULT_DRAFT, engine_options, make_proposer, new_decoder
from onlinespec.models import load_target
from onlinespec.online.buffer import ReplayBuffer
from onlinespec.online.recorder import records_from_generation

MODES = ("plain", "index", "online")


def serve_mode(decoder, mode: str, chunk, prompts, params, buffer, row: dict) -> list:
    """One round in one mode: its tokens/s (the online mode's records built and written durably
    counted in), tau and drafters into ``row``; the outputs' token ids."""
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
        row.update(traced_s=serving, records_s=built, writes_s=time.perf_counter() - tick)
        serving += built + row["writes_s"]
    drafters: dict[str, list[int]] = {}
    for o in outs:
        for name, (sent, kept) in o.stats.by_drafter.items():
            tally = drafters.setdefault(name, [0, 0])
            tally[0], tally[1] = tally[0] + sent, tally[1] + kept
    new = sum(len(o.token_ids) for o in outs)
    row[mode] = {"tokens_per_s": new / serving, "tau": new / max(1, sum(o.stats.rounds for o in outs)), "drafters": drafters}
    return [o.token_ids for o in outs]


def summary(rows: list[dict], modes: list[str], args, backend: str) -> None:
    print(f"{backend}, {args.in_flight} in flight, {args.rounds} rounds of {args.per_round} requests ({args.domains}), "
          f"48 new tokens, default hybrid (medians over rounds):")
    for m in modes:
        ratio = "" if m == "plain" else f", per-round ratio to plain {statistics.median(r[m]['tokens_per_s'] / r['plain']['tokens_per_s'] for r in rows):.3f}"
        print(f"  {m}: {statistics.median(r[m]['tokens_per_s'] for r in rows):.1f} tok/s, tau {statistics.median(r[m]['tau'] for r in rows):.3f}{ratio}")
    if "online" in modes:
        print(f"  online, per round: serving traced {statistics.median(r['traced_s'] for r in rows):.2f} s, building records "
              f"{statistics.median(r['records_s'] for r in rows) * 1e3:.0f} ms, durable buffer writes "
              f"{statistics.median(r['writes_s'] for r in rows) * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=16, help="requests per round")
    parser.add_argument("--modes", default="plain,online", help=f"of {', '.join(MODES)} (plain always)")
    parser.add_argument("--domains", default="chat,code,math")
    parser.add_argument("--json", type=Path, help="write the per-round figures here")
    args = parser.parse_args()
    modes = ["plain"] + [m for m in args.modes.split(",") if m != "plain"]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}: give some of {', '.join(MODES)}")
    target = load_target("default", backend=args.backend, device="cpu")
    options = engine_options(target, DEFAULT_K, adaptive=True, kernels=True, max_batch=args.in_flight)
    drafts = {m: (make_proposer(DEFAULT_DRAFT, target, "float32").proposer, copy.deepcopy(options["adaptive_k"])) for m in modes}
    decoder = new_decoder(target, drafts["plain"][0], DEFAULT_K, options, args.in_flight)
    index = drafts["index"][0].suffix_index if "index" in drafts else None
    buffer = ReplayBuffer(tempfile.mkdtemp(), "window", max_records=100_000)
    params = SamplingParams(max_new_tokens=48)
    queries = packaged_prompts(args.rounds * args.per_round, tuple(args.domains.split(",")), seed=3, split="online")
    decoder.generate_many([list(q.messages) if q.messages else q.prompt for q in queries[:2]], SamplingParams(max_new_tokens=4))  # warm-up
    rows = []
    for r in range(args.rounds):
        chunk = queries[r * args.per_round:(r + 1) * args.per_round]
        prompts = [list(q.messages) if q.messages else q.prompt for q in chunk]
        row: dict = {"round": r + 1, "index_requests": len(index) if index is not None else 0}
        texts = {}
        for mode in harness.rotated(modes, r):
            decoder.proposer, decoder.adaptive_k = drafts[mode]
            texts[mode] = serve_mode(decoder, mode, chunk, prompts, params, buffer, row)
        if index is not None:
            for q, tokens in zip(chunk, texts["plain"]):
                index.add(decoder.encode(list(q.messages) if q.messages else q.prompt) + tokens, q.id)
        row["same_text"] = {m: sum(a == b for a, b in zip(texts[m], texts["plain"])) for m in modes if m != "plain"}
        rows.append(row)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{m} {row[m]['tokens_per_s']:.1f} tok/s (tau {row[m]['tau']:.2f})" for m in modes)
              + "".join(f"; {m} {row[m]['drafters']}" for m in modes), flush=True)
    summary(rows, modes, args, target.backend)
    if args.json:
        harness.write_result(args.json, {"args": vars(args) | {"json": str(args.json)}, "backend": target.backend, "rounds": rows})


if __name__ == "__main__":
    main()
