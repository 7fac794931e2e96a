"""What the token sampler costs a sampled request: ``torch.multinomial`` (one exponential variate
per vocabulary entry) against the inverse-CDF draw the engine uses (onlinespec.decoding.sampling.sample),
on the packaged target (llama.cpp, its 49k vocabulary) at one request in flight.

Each prompt is served by the default draft (hybrid) and by the target alone, with either
sampler, the four arms interleaved prompt by prompt (this machine's speed drifts), the same seed
per prompt. Writes docs/results/sampler.json (the doc: docs/engine.md, "Sampling").

    python bench/sampler.py --prompts 24 --max-new-tokens 64 --temperature 0.8
"""

from __future__ import annotations

import argparse
import statistics
import time

import harness
import torch


def multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """The sampler before 2026-12-06."""
    return int(torch.multinomial(probs, 1, generator=generator))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--out", default=str(harness.RESULTS / "sampler.json"))
    args = parser.parse_args()

    import onlinespec.decoding.proposers.draft_model as draft_model
    import onlinespec.decoding.proposers.feature as feature
    import onlinespec.decoding.verify as verify
    from onlinespec.data import packaged_prompts
    from onlinespec.decoding.sampling import SamplingParams, sample
    from onlinespec.factory import engine_options, make_proposer, new_decoder
    from onlinespec.models import load_target

    samplers = {"multinomial": multinomial, "inverse CDF": sample}
    modules = (verify, feature, draft_model)  # every caller of sampling.sample

    def use(sampler) -> None:
        for module in modules:
            module.sample = sampler

    target = load_target("default", backend="auto", device="cpu")
    options = engine_options(target, 4, adaptive=True)
    decoders = {"hybrid": new_decoder(target, make_proposer("hybrid", target).proposer, 4, options),
                "target alone": new_decoder(target, None, 0)}
    queries = packaged_prompts(args.prompts, seed=3)
    arms = [(d, s) for d in decoders for s in samplers]
    rows = []
    for i, query in enumerate(queries):
        for decoder_name, sampler_name in harness.rotated(arms, i):
            use(samplers[sampler_name])
            params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=1000 + i)
            started = time.perf_counter()
            out = decoders[decoder_name].generate(list(query.messages), params)
            seconds = time.perf_counter() - started
            rows.append({"prompt": i, "decoder": decoder_name, "sampler": sampler_name, "tokens": len(out.token_ids),
                         "seconds": seconds, "accepted": out.stats.accepted, "proposed": out.stats.proposed})
        print(f"{i + 1}/{len(queries)}", flush=True)
    use(sample)
    summary = {}
    for decoder_name in decoders:
        rate = {s: sum(r["tokens"] for r in rows if r["decoder"] == decoder_name and r["sampler"] == s)
                / sum(r["seconds"] for r in rows if r["decoder"] == decoder_name and r["sampler"] == s) for s in samplers}
        paired = [a["seconds"] / a["tokens"] / (b["seconds"] / b["tokens"])
                  for a, b in zip(*([r for r in rows if r["decoder"] == decoder_name and r["sampler"] == s] for s in samplers))
                  if a["tokens"] and b["tokens"]]
        summary[decoder_name] = {"tokens_per_s": rate, "speedup": rate["inverse CDF"] / rate["multinomial"],
                                 "median_paired_time_ratio": statistics.median(paired)}
        print(decoder_name, {k: round(v, 2) for k, v in rate.items()}, f"{summary[decoder_name]['speedup']:.3f}x")
    harness.write_result(args.out, {"summary": summary, "config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
