"""The online experiments of arXiv 2310.07177, section 5 on our data: Figures 3 and 4, static
references, forgetting, and end-to-end tokens/s of online draft vs static draft vs target alone.

The starting draft is the chat-only feature head of Table 1 (bench/table1.py builds it), so code
and maths in 23 languages are domains it was not trained on. Streams come from the online split
(never used in any warm-up), prompts of at most 256 tokens, 64 new tokens per request, greedy:

- abrupt: 300 code -> 300 maths (23 languages) -> 300 chat, served by the online system with the
  learner in the background; every 10th request also by the static starting draft and the target
  alone (same process, same load), then again with the learner stopped (its cost on serving);
- gradual: 300 requests of the same queries, each block's next domain mixing in from 0 to 100%.

References: the starting draft distilled OFFLINE on the first 30%, 70% and 100% of each domain's
stream requests (the target's greedy answers, teacher-forced, as in the paper's Figure 4). A draft
that never served the stream is scored on it by replaying speculative decoding over the target's
answers (:func:`onlinespec.drafts.train.replay_acceptance`): exact for greedy fixed-k decoding, and
checked here against the live static probes.

    python bench/online_experiments.py                 # ~95 min on 2 CPU cores; stages are cached
    python bench/online_experiments.py --report-only   # tables and plots from the saved results

Writes docs/results/online-experiments.md, docs/results/online-fig3.png, docs/results/online-fig4.png and
docs/results/online-experiments.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from onlinespec.data.sources import MATH_ML_LANGUAGES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"
WORK = ROOT / "runs" / "online-exp"
PER_DOMAIN = 300
GRADUAL_EVERY = 100
MAX_PROMPT_TOKENS = 256
NEW_TOKENS = 64
K = 4
HELDOUT_PER_DOMAIN = 40
FRACTIONS = (0.3, 0.7, 1.0)
DOMAIN_ORDER = ("code", "math_ml", "chat")


def pools(tokenizer, split_name: str) -> dict:
    """Per domain, the split's queries whose prompt fits ``MAX_PROMPT_TOKENS`` (deterministic order)."""
    from onlinespec.data.sources import stream_pools
    from onlinespec.data.splits import split
    from onlinespec.tokens import encode_prompt

    raw = stream_pools(DOMAIN_ORDER)
    fits = lambda q: len(encode_prompt(tokenizer, list(q.messages) if q.messages else q.prompt)) <= MAX_PROMPT_TOKENS
    return {d: [q for q in split(raw[d], split_name) if fits(q)] for d in DOMAIN_ORDER}


def streams(tokenizer) -> tuple[list, list]:
    from onlinespec.data.streams import abrupt_shifts, gradual_mix

    abrupt = abrupt_shifts(pools(tokenizer, "online"), PER_DOMAIN, seed=0)
    by_domain = {d: [q for q in abrupt if q.domain == d] for d in DOMAIN_ORDER}
    return abrupt, gradual_mix(by_domain, GRADUAL_EVERY, seed=1)


def heldout_queries(tokenizer) -> list:
    import random

    out = []
    for domain, pool in pools(tokenizer, "heldout").items():
        out += random.Random(f"heldout:{domain}").sample(pool, HELDOUT_PER_DOMAIN)
    return out


def teacher_signal(target, queries):
    from onlinespec.distill.signal import SignalConfig, build_signal
    from onlinespec.drafts.warmup import signal_key

    config = SignalConfig(sampling="teacher", max_new_tokens=NEW_TOKENS, max_prompt_tokens=MAX_PROMPT_TOKENS, batch_size=16)
    return build_signal(target.model, target.tokenizer, queries, config, cache_as=signal_key(target))


def original_head(target) -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    from table1 import WORK as TABLE1
    from table1 import build_original

    folder = TABLE1 / "original"
    if not (folder / "feature_head.json").exists():
        from onlinespec.drafts.specialise import domain_queries
        from onlinespec.models import load_model

        build_original(load_model("default", "bfloat16"), 800, {q.id for d in ("chat", "code", "math") for q in domain_queries(d, 64)})
    return folder


def train_reference(target, original: Path, signal, fraction: float) -> Path:
    """The starting draft distilled offline on the first ``fraction`` of each domain's stream answers."""
    import torch

    from onlinespec.distill.step import DistillConfig
    from onlinespec.distill.trainer import TrainConfig, Trainer
    from onlinespec.drafts.train import ChainConfig, ChainTask
    from onlinespec.factory import load_head

    out = WORK / f"ref-{round(fraction * 100)}"
    if (out / "feature_head.json").exists():
        return out
    keep = []
    for domain in DOMAIN_ORDER:
        ids = [i for i, d in enumerate(signal.domains) if d == domain]
        keep += ids[: round(len(ids) * fraction)]
    part = signal.select(keep)
    torch.manual_seed(0)
    head = load_head(original, target)
    task = ChainTask(part, ChainConfig())
    steps = max(100, round(2 * len(task) / 256))  # 2 epochs over the chain starts
    config = TrainConfig(steps=steps, batch_size=256, lr=1e-3, warmup_steps=50, checkpoint_every=500, distill=DistillConfig("fkl"))
    Trainer(head, task.starts.tolist(), WORK / f"ref-{round(fraction * 100)}.work", config, step_fn=task.step).run()
    head.save(out, {"trained_on": f"{len(part)} stream answers ({fraction:.0%} of each domain)", "steps": steps})
    return out


LEARNER = {"update_interval": 25, "steps_per_update": 40, "batch_size": 64, "lr": 1e-3, "position_policy": "verified", "sampling": "teacher"}


def online_run(name: str, queries: list, original: Path, compare_every: int) -> dict:
    """Serve ``queries`` with the online system (the learner in the background, at low priority)."""
    from onlinespec.online.learner import LearnerConfig
    from onlinespec.serve.config import CoreConfig
    from onlinespec.stream import OnlineConfig

    core = CoreConfig(
        draft=f"head:{original}", k=K, adaptive_k=False, buffer_policy="window", buffer_records=2000,
        learner=LearnerConfig(**LEARNER),
        router="single",  # the paper's Figures 3 and 4: one draft follows the stream across its shifts
    )
    config = OnlineConfig(core, max_new_tokens=NEW_TOKENS, compare_every=compare_every)
    return serve_cached(WORK / name, name, queries, config)


def serve_cached(folder: Path, name: str, queries: list, config) -> dict:
    """Run the stream into ``folder`` (``result.json``, cached; the run in ``folder/run``), with progress."""
    from onlinespec.stream import run_stream

    path = folder / "result.json"
    if path.exists():
        return json.loads(path.read_text())
    run_dir = folder / "run"
    if run_dir.exists():  # a half-done run is not resumed into a figure: start it again
        import shutil

        shutil.rmtree(run_dir)
    started = time.time()

    def progress(row: dict) -> None:
        if row["i"] % 25 == 0:
            print(f"[{name}] {row['i']:4d} {row['domain']:8s} alpha(50) {row['alpha_moving_average']:.3f} "
                  f"{row['tokens_per_s']:5.1f} tok/s draft {row['draft']} {row['draft_version']} ({time.time() - started:.0f} s)", flush=True)

    result = run_stream(queries, config, run_dir, progress, lambda text: print(f"[{name}] {text}", flush=True))
    path.write_text(json.dumps(result))
    return result


def replay_stream(target, heads: dict, signal) -> dict:
    """``{draft: {query id: [accepted, judged]}}`` by replaying each draft over the target's answers."""
    from onlinespec.drafts.train import replay_acceptance

    return {name: dict(zip(signal.query_ids, map(list, replay_acceptance(head, signal, K)))) for name, head in heads.items()}


def online_versions(target, original: Path, result: dict, run_dir: Path) -> dict:
    """The online draft as it stood at the end of each domain segment of the abrupt stream, and at the end."""
    from onlinespec.factory import load_head
    from onlinespec.online.registry import DraftRegistry
    from onlinespec.routing.domains import SHARED
    from onlinespec.weights import load_weights

    registry = DraftRegistry(run_dir / "drafts" / SHARED)
    rows = result["requests"]
    picks = {}
    for i, row in enumerate(rows):
        if i + 1 == len(rows) or rows[i + 1]["domain"] != row["domain"]:
            picks[f"online after {row['domain']}"] = rows[i + 1]["draft_version"] if i + 1 < len(rows) else registry.current()
    heads = {}
    for label, version in picks.items():
        head = load_head(original, target)
        load_weights(head, registry.load(version), f"{version} of {registry.directory}")
        heads[f"{label} ({version})"] = head.eval()
    return heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--stage", default="all", help="signal | refs | abrupt | gradual | replay | all")
    args = parser.parse_args()
    if args.report_only:
        report(json.loads((WORK / "results.json").read_text()))
        return
    from onlinespec.factory import load_head
    from onlinespec.models import load_model

    target = load_model("default", "float32")
    abrupt, gradual = streams(target.tokenizer)
    signal = teacher_signal(target, abrupt)
    heldout = teacher_signal(target, heldout_queries(target.tokenizer))
    original = original_head(target)
    if args.stage in ("refs", "all"):
        for fraction in FRACTIONS:
            train_reference(target, original, signal, fraction)
    if args.stage in ("abrupt", "all"):
        online_run("abrupt", abrupt, original, compare_every=10)
    if args.stage in ("gradual", "all"):
        online_run("gradual", gradual, original, compare_every=0)
    if args.stage not in ("replay", "all"):
        return
    heads = {"static (starting draft)": load_head(original, target)}
    for fraction in FRACTIONS:
        heads[f"static {fraction:.0%} (offline)"] = load_head(WORK / f"ref-{round(fraction * 100)}", target)
    results = {"abrupt": json.loads((WORK / "abrupt" / "result.json").read_text()),
               "gradual": json.loads((WORK / "gradual" / "result.json").read_text())}
    forgetting_heads = {"static (starting draft)": heads["static (starting draft)"], "static 100% (offline)": heads["static 100% (offline)"],
                        **online_versions(target, original, results["abrupt"], WORK / "abrupt" / "run")}
    out = {
        "settings": {"per_domain": PER_DOMAIN, "gradual_every": GRADUAL_EVERY, "k": K, "new_tokens": NEW_TOKENS,
                     "max_prompt_tokens": MAX_PROMPT_TOKENS, "learner": LEARNER, "math_languages": MATH_ML_LANGUAGES,
                     "heldout_per_domain": HELDOUT_PER_DOMAIN, "date": time.strftime("%Y-%m-%d"), "torch_threads": torch_threads()},
        "runs": results,
        "replay": replay_stream(target, heads, signal),
        "heldout": {name: by_domain(heldout, counts) for name, counts in replay_stream(target, forgetting_heads, heldout).items()},
    }
    (WORK / "results.json").write_text(json.dumps(out))
    report(out)


def moving_average(pairs: list) -> list[float]:
    """Per request, the mean per-request alpha over the last 50 requests (as the paper plots it)."""
    from onlinespec.stream import moving_average as average

    return average([a / j if j else 0.0 for a, j in pairs])


def segments(rows: list) -> list[tuple[str, int, int]]:
    out, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i]["domain"] != rows[start]["domain"]:
            out.append((rows[start]["domain"], start, i))
            start = i
    return out


def report(out: dict) -> None:
    """docs/results/online-experiments.md (its figures and tables) and .json from the stages' results."""
    DOCS.mkdir(parents=True, exist_ok=True)
    replay, runs = out["replay"], out["runs"]
    refs = list(replay)
    summary: dict = {}
    figure4(runs, replay, refs)
    lines = [*intro(out), *figure3(runs, replay, refs, summary), *shift_table(runs, replay, refs), *throughput(runs, replay),
             *forgetting(out["heldout"], summary)]
    out["must_show"] = summary
    (DOCS / "online-experiments.md").write_text("\n".join(lines) + "\n")
    (DOCS / "online-experiments.json").write_text(json.dumps({k: v for k, v in out.items() if k != "replay"} | {
        "runs": {n: {k: v for k, v in r.items() if k != "requests"} for n, r in runs.items()}}, indent=1))
    print("\n".join(lines))


def intro(out: dict) -> list[str]:
    return ["# Online speculative decoding on shifting traffic (arXiv 2310.07177, section 5, Figures 3 and 4)", "",
             (f"Command: `python bench/online_experiments.py` ({out['settings']['date']}, 2 CPU cores, fp32 target "
             f"SmolLM2-135M-Instruct, {out['settings']['torch_threads']} serving threads). Greedy, k = {K} fixed, "
             f"{NEW_TOKENS} new tokens a request, prompts of at most {MAX_PROMPT_TOKENS} tokens from the online split."), "",
             ("Starting draft: the chat-only feature head of Table 1 (it never saw code or maths). Online learner: "
             f"`{json.dumps(out['settings']['learner'])}`, in a background thread at the lowest OS priority, "
             "window buffer of 2,000 records, gate on the newest 20%."), "",
             ("alpha is the share of judged proposals accepted, per request; curves are its moving average over the "
             "last 50 requests. The online curve is measured live. Static drafts (the starting draft, and the starting "
             "draft distilled offline on the first 30/70/100% of each domain's stream requests) are scored by replaying "
             "speculative decoding over the target's greedy answers, which a test shows equal to a live fixed-k run; "
             "the live static probes below check it on this stream."), "",
             ("**Read the static references with care.** They were distilled on the stream's own answers, so on the "
             "requests they were trained on they recite memorised text (alpha 0.74-0.80: the flat top of each curve), "
             "and on the rest of the segment they fall to 0.37-0.55 (the 30% and 70% curves after their cut). The "
             "held-out table at the end shows the same drafts on prompts nobody trained on."), ""]


def figure4(runs: dict, replay: dict, refs: list[str]) -> None:
    """Figure 4: alpha over the abrupt and the gradual stream, online and the static references."""
    fig, axes = harness.figure(2, 1, figsize=(11, 7.5))
    for ax, name in zip(axes, ("abrupt", "gradual")):
        rows = runs[name]["requests"]
        ids = [r["id"] for r in rows]
        ax.plot(range(len(rows)), [r["alpha_moving_average"] for r in rows], label="online (live)", color="C3", linewidth=2)
        for n, ref in enumerate(refs):
            ax.plot(range(len(rows)), moving_average([replay[ref][q] for q in ids]), label=ref, color=f"C{n}", linewidth=1)
        for domain, a, b in segments(rows):
            if name == "abrupt":
                if a:
                    ax.axvline(a, color="grey", linestyle="--", linewidth=0.8)
                ax.text((a + b) / 2, 1.0, domain, ha="center", va="bottom", transform=ax.get_xaxis_transform())
        ax.set_title(f"{name} shifts: code -> maths (23 languages) -> chat", pad=14)
        ax.set_xlabel("request")
        ax.set_ylabel("alpha (moving average, 50)")
        ax.set_ylim(0, 0.85)
    axes[0].legend(fontsize=8, ncol=3, loc="lower right")
    harness.save(fig, DOCS / "online-fig4.png", dpi=110)


def figure3(runs: dict, replay: dict, refs: list[str], summary: dict) -> list[str]:
    """Figure 3: per domain segment of the abrupt stream, moving averages restarted at each segment; its table
    (``summary`` gets each domain's rise and catch-up)."""
    rows = runs["abrupt"]["requests"]
    fig, axes = harness.figure(1, 3, figsize=(13, 3.8), sharey=True)
    lines = ["## Per domain (abrupt stream, Figure 3)", "",
              ("Moving averages restarted at each segment. Rise = online alpha over the segment's last 50 requests "
              "minus its first 50. Catch-up = the first request of the segment from which the online moving average "
              "stays within 0.05 of the static draft distilled on 100% of the stream."), "",
              "| domain | online first 50 | online last 50 | rise | static start | static 30% | static 70% | static 100% | catch-up (request of 300) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for ax, (domain, a, b) in zip(axes, segments(rows)):
        seg = rows[a:b]
        live = moving_average([(r["accepted"], r["judged"]) for r in seg])
        ref_ma = {ref: moving_average([replay[ref][r["id"]] for r in seg]) for ref in refs}
        ax.plot(live, label="online (live)", color="C3", linewidth=2)
        for n, ref in enumerate(refs):
            ax.plot(ref_ma[ref], label=ref, color=f"C{n}", linewidth=1)
        ax.set_title(domain)
        ax.set_xlabel("request in segment")
        pooled = lambda pairs: sum(x for x, _ in pairs) / max(1, sum(y for _, y in pairs))
        first = statistics.fmean(r["acceptance_rate"] for r in seg[:50])
        last = statistics.fmean(r["acceptance_rate"] for r in seg[-50:])
        full = ref_ma["static 100% (offline)"]
        within = [i for i in range(len(seg)) if all(live[j] >= full[j] - 0.05 for j in range(i, len(seg)))]
        catch = within[0] + 1 if within else None
        ref_cells = " | ".join(f"{pooled([replay[ref][r['id']] for r in seg]):.3f}" for ref in refs)
        lines.append(f"| {domain} | {first:.3f} | {last:.3f} | {last - first:+.3f} | {ref_cells} | {catch if catch else 'not reached'} |")
        summary[domain] = {"first_50": first, "last_50": last, "rise": last - first, "catch_up_request": catch}
    axes[0].set_ylabel("alpha (moving average, 50)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Online alpha per domain vs static drafts (abrupt stream)")
    harness.save(fig, DOCS / "online-fig3.png", dpi=110)
    return lines


def shift_table(runs: dict, replay: dict, refs: list[str]) -> list[str]:
    lines = ["", "![per domain](online-fig3.png)", "", "## Shifts (Figure 4)", "", "![shifts](online-fig4.png)", "",
              "| stream | domain | online (live) | " + " | ".join(refs) + " |", "|---|---|---|" + "---|" * len(refs)]
    for name in ("abrupt", "gradual"):
        rows = runs[name]["requests"]
        for domain in DOMAIN_ORDER:
            part = [r for r in rows if r["domain"] == domain]
            online = sum(r["accepted"] for r in part) / max(1, sum(r["judged"] for r in part))
            cells = " | ".join(f"{sum(replay[ref][r['id']][0] for r in part) / max(1, sum(replay[ref][r['id']][1] for r in part)):.3f}" for ref in refs)
            lines.append(f"| {name} | {domain} | {online:.3f} | {cells} |")
    return lines


def throughput(runs: dict, replay: dict) -> list[str]:
    """End-to-end tokens/s in the abrupt run, the replay check and the updates."""
    comparison = runs["abrupt"]["comparison"]
    tps, ratio, onoff = comparison["tokens_per_s"], comparison["median_ratio"], comparison["learning_on_vs_off"]
    lines = ["", "## End-to-end tokens/s (abrupt stream, one run)", "",
              (f"Every 10th request ({comparison['n_requests']}) was served by the online system and by the static "
              "starting draft (order alternating), and after the stream, learning paused, by the static draft and the "
              "target alone again, by the same serving core. Greedy outputs "
              f"identical on {comparison['identical']}/{comparison['n_requests']}."), "",
              "| | online | static draft | target alone |", "|---|---|---|---|",
              f"| tokens/s (pooled) | {tps['online']:.1f} | {tps['static']:.1f} | {tps['target_alone']:.1f} |",
              f"| median per-request ratio to target alone | {ratio['online/target_alone']:.2f}x | {ratio['static/target_alone']:.2f}x | 1 |",
              "", (f"Online / static, median per-request ratio: {ratio['online/static']:.2f}x. Over all "
              f"{runs['abrupt']['summary']['n_requests']} requests the online system served "
              f"{runs['abrupt']['summary']['tokens_per_s']:.1f} tok/s."), "",
              ("**Cost of the background learner on serving** (the same probe requests served again by the static draft "
              "once learning was paused; fixed work, so only the learner differs): "
              f"static draft {onoff['static']:.1%} of its learning-off throughput (median per request "
              f"{onoff['static_median_ratio']:.1%}); {onoff['requests_with_learner_busy']} of {comparison['n_requests']} "
              "probe requests ran while an update was in flight."), ""]
    probes = [r for r in runs["abrupt"]["requests"] if "static" in r]
    live = sum(r["static"]["accepted"] for r in probes) / max(1, sum(r["static"]["judged"] for r in probes))
    replayed = sum(replay["static (starting draft)"][r["id"]][0] for r in probes) / max(1, sum(replay["static (starting draft)"][r["id"]][1] for r in probes))
    same = sum(tuple(replay["static (starting draft)"][r["id"]]) == (r["static"]["accepted"], r["static"]["judged"]) for r in probes)
    lines += [(f"Replay check: on the {len(probes)} probe requests the static starting draft accepted {live:.3f} live and "
              f"{replayed:.3f} replayed; (accepted, judged) identical on {same}/{len(probes)} requests."), ""]
    updates = runs["abrupt"]["updates"]
    published = [u for u in updates if u["version"]]
    lines += [(f"Updates (abrupt): {len(updates)}, {len(published)} published; median update time "
              f"{statistics.median(u['seconds'] for u in updates):.0f} s (low priority: it runs on what serving leaves)."), ""]
    return lines


def forgetting(held: dict, summary: dict) -> list[str]:
    """Held-out alpha per draft and domain, and the findings."""
    lines = ["## Forgetting (held-out prompts, 40 per domain, replayed)", "",
              "| draft | " + " | ".join(DOMAIN_ORDER) + " |", "|---|" + "---|" * len(DOMAIN_ORDER)]
    for name, by in held.items():
        lines.append(f"| {name} | " + " | ".join(f"{by[d]:.3f}" for d in DOMAIN_ORDER) + " |")
    start_chat, after_code_chat = held["static (starting draft)"]["chat"], next(v for k, v in held.items() if k.startswith("online after code"))["chat"]
    lines += ["", "## Findings", "",
              (f"- **Maths, unseen by the starting head, is learnt online:** alpha {summary['math_ml']['first_50']:.3f} over the "
              f"segment's first 50 requests, {summary['math_ml']['last_50']:.3f} over its last 50 ({summary['math_ml']['rise']:+.3f}); "
              "the static head stays near 0.15. On held-out maths prompts the final online head reaches "
              f"{list(held.values())[-1]['math_ml']:.3f} against the starting head's {held['static (starting draft)']['math_ml']:.3f}."),
              (f"- **Code is not learnt, and chat is forgotten:** after the code segment the head is no better on code, and its "
              f"held-out chat alpha fell from {start_chat:.3f} to {after_code_chat:.3f}; it never recovered on the chat segment. "
              "Every update trains on the whole window buffer with a constant learning rate of 1e-3, and the gate judges a "
              "candidate only on the newest 20% of records, which never include the domains it may be damaging."),
              ("- **Part of the damage was a fault, now fixed:** each update built a fresh AdamW, whose first steps move every "
              "weight by about the learning rate. Simulating the code segment offline with the same schedule "
              "(`python bench/online_sim.py 25 40 64 1e-3 code [fresh]`: train on the answers so far, score the next 25 by "
              "replay), a fresh optimizer per update ends at 0.33-0.34 and a persistent one at 0.35-0.36 (the learner now "
              "carries the optimizer state on): a small part of the gap. Neither reaches the 30% reference's 0.37-0.40 on "
              "code requests it did not see."),
              ("- **The static references are not reachable targets here:** within 0.05 of the 100% reference means reciting "
              "answers it memorised; on held-out prompts the 100% reference scores 0.41 / 0.48 / 0.49 (code / maths / chat)."),
              ("- **The learner costs serving almost nothing** at the lowest OS priority (97-98% of learning-off throughput), "
              "but it learns slowly on 2 saturated cores: an update of 40 steps took a median 148 s, one per 40-50 requests."),
              ("- **Next:** hold out a slice of every domain seen so far in the gate (not only the newest records), mix "
              "recent and older records per batch, lower the learning rate with the persistent optimizer, and rerun with the "
              "hybrid proposer (n-gram lookup carries code).")]
    return lines


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def by_domain(signal, counts: dict) -> dict:
    out = {}
    for domain in DOMAIN_ORDER:
        pairs = [counts[q] for q, d in zip(signal.query_ids, signal.domains) if d == domain]
        out[domain] = sum(a for a, _ in pairs) / max(1, sum(j for _, j in pairs))
    return out


if __name__ == "__main__":
    main()
