"""What separating tenants costs in acceptance: the same stream served with one suffix index that
every client shares (``--shared-suffix``) and with the index split among T tenants (the default:
a tenant's lookups see its own earlier requests only, docs/reliability.md, "Tenants").

One run serves the same ``--n`` online-split requests of ``--domain`` through the serving core in
this process, once per tenant count (request i belongs to tenant ``i % T``; T = 1 is the shared
index), with the default target and draft, the suffix index learning and the head static (so the
index is the only thing that differs). It reports, per T, alpha pooled over the requests, the
tokens the suffix index proposed and the target kept, and tokens/s; acceptance is deterministic
(greedy), so it needs no interleaving, while tokens/s is only indicative (runs follow each other)::

    python bench/tenant_cost.py --domain math_ml --n 120 --tenants 1,4,16 --out docs/results/tenant-cost
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from onlinespec.data.sources import stream_pools
from onlinespec.data.splits import split as split_queries
from onlinespec.decoding.sampling import SamplingParams
from onlinespec.serve.config import CoreConfig
from onlinespec.serve.core import ServingCore

WORK = harness.RUNS / "tenant-cost"


def serve(queries, tenants: int, new_tokens: int) -> dict:
    out_dir = WORK / f"t{tenants}"
    shutil.rmtree(out_dir, ignore_errors=True)
    core = ServingCore(CoreConfig(learn=True, head_updates=False, router="single", shared_suffix=tenants == 1,
                                  speculation_details=True), out_dir)
    core.load()
    accepted = judged = suffix_sent = suffix_kept = tokens = 0
    seconds = 0.0
    try:
        for i, q in enumerate(queries):
            served = core.submit(list(q.messages) if q.messages else q.prompt, SamplingParams(temperature=0.0, max_new_tokens=new_tokens),
                                 tenant=f"t{i % tenants}").result()
            s = served.stats
            accepted, judged = accepted + s.accepted, judged + s.accepted + s.rejected
            sent, kept = s.by_drafter.get("suffix", (0, 0))
            suffix_sent, suffix_kept = suffix_sent + sent, suffix_kept + kept
            tokens, seconds = tokens + len(served.token_ids), seconds + s.seconds
            if (i + 1) % 20 == 0:
                print(f"  T={tenants}: {i + 1}/{len(queries)} requests, alpha {accepted / max(judged, 1):.3f}", flush=True)
    finally:
        core.shutdown()
    return {"tenants": tenants, "alpha": accepted / max(judged, 1), "suffix_proposed": suffix_sent, "suffix_accepted": suffix_kept,
            "accepted": accepted, "tokens": tokens, "tokens_per_s": tokens / seconds if seconds else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--domain", default="math_ml")
    parser.add_argument("--n", type=int, default=120)
    parser.add_argument("--tenants", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "tenant-cost")
    args = parser.parse_args()
    queries = split_queries(stream_pools([args.domain])[args.domain], "online")[: args.n]
    rows = []
    for t in [int(x) for x in args.tenants.split(",")]:
        print(f"serving {len(queries)} {args.domain} requests as {t} tenant(s)", flush=True)
        rows.append(serve(queries, t, args.new_tokens))
        print(f"  -> {rows[-1]}", flush=True)
    result = {"rows": rows}
    harness.write_result(args.out.with_suffix(".json"), result, command=["python", "bench/tenant_cost.py", "--domain", args.domain, "--n", str(args.n),
                                                                         "--tenants", args.tenants, "--new-tokens", str(args.new_tokens)])
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    rows = result["rows"]
    fig, ax = harness.figure(figsize=(5.5, 3.5))
    labels = ["shared" if r["tenants"] == 1 else f"{r['tenants']} tenants" for r in rows]
    ax.bar(labels, [r["alpha"] for r in rows], color=["#888"] + ["#4a7"] * (len(rows) - 1))
    for i, r in enumerate(rows):
        ax.text(i, r["alpha"], f"{r['alpha']:.3f}\nsuffix kept {r['suffix_accepted']}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("alpha (pooled)")
    ax.set_title("Acceptance: one shared suffix index vs one per tenant", fontsize=10)
    ax.set_ylim(0, max(r["alpha"] for r in rows) * 1.3)
    harness.save(fig, path)


if __name__ == "__main__":
    main()
