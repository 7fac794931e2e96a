"""Why online updates on a familiar domain were refused, and what makes them pass and help.

A replay of the online learner on one domain, without serving: the target's greedy answers to
``--stream`` online-split requests (48 new tokens, cached), a learner that every ``I`` requests
trains a copy of the serving head on the answers so far (less the gate's hold-out), a gate that
publishes the copy only if its alpha on the hold-out is no worse, and the truth the gate tries to
guess: the hybrid's alpha (n-gram lookup + head, replayed exactly, ``replay_acceptance``) on
``--heldout`` requests of the held-out split that no update ever saw. One row per hypothesis::

    python bench/gate_experiments.py --domain stdlib --out docs/results/gate-experiments

Hypotheses (each row changes one thing from ``baseline``, the learner's settings in the issue:
I = 10, 40 steps of batch 32 at lr 3e-4 on every verified position, Adam state carried on, the
gate holding out the newest 20% of requests):
- ``lr 1e-4``: the step size overfits a few requests;
- ``1 epoch``: 40 x 32 examples are several passes over 10 requests' rows: cap steps at one
  epoch of the rows so far;
- ``head rows``: rows the n-gram lookup would have proposed teach the head what it never drafts;
- ``hold-out positions``: the newest requests are other functions, so the hold-out measures
  transfer to new code, not fit; hold out a random 20% of positions of every request instead;
- ``I = 25``: more data per update;
- and, after the first round, the learning rate and steps around the best of them.

Gates that can tell (``--out docs/results/gate-experiments-next``, the ``next ...`` rows): every
candidate is also scored, in the shadow of the gate that decides, by the gates below, so all are
compared on the same candidates (``--analyse FILE.json`` recomputes the table from a saved run):
- ``holdout first``: the learner's gate (first-proposal agreement, newest 20% held out);
- ``holdout hybrid``: the truth's metric (hybrid replayed alpha) on that same hold-out;
- ``next N first`` / ``next N hybrid``: the next N requests of the stream after the update
  (``seen .. seen + N``: recorded verifications no update trained on), first-proposal agreement
  or the hybrid's replayed alpha, serving head vs candidate; publish if the candidate is no worse;
- ``next N hybrid > -1 se`` / ``> +1 se``: the same pooled difference against its standard error
  (bootstrap over the N requests, paired): publish unless worse / only if better by one s.e.
A ``next`` row lets that gate decide and trains on every request seen (it needs no hold-out).
The truth's own noise: a bootstrap of the held-out requests (paired) gives each candidate's
truth change a standard error; the table counts agreement overall and on the candidates whose
truth change exceeds 1.96 s.e. ("decidable").
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from onlinespec.data.sources import stream_pools
from onlinespec.data.splits import split
from onlinespec.distill.loop import run_steps
from onlinespec.distill.signal import Signal, SignalConfig, build_signal
from onlinespec.distill.step import DistillConfig
from onlinespec.drafts.train import HYBRID_REPLAY, ChainConfig, ChainTask, replay_acceptance
from onlinespec.factory import DEFAULT_HEAD, load_head
from onlinespec.models import load_model
from onlinespec.online.schedule import UpdatePlan, UpdateSchedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from online_sim import ngram_covered  # the rounds the hybrid drafts by n-gram lookup

NEW_TOKENS = 48


@dataclass(frozen=True)
class Setting:
    name: str
    interval: int = 10
    steps: int = 40
    batch: int = 32
    lr: float = 3e-4
    epoch_cap: bool = False
    head_rows: bool = False
    holdout: str = "requests"  # requests: the newest 20% of requests; positions: 20% of every request's positions; none
    gate: str = "holdout first"  # the rule that publishes (a key of RULES)
    shift_updates: int = 0  # the learner's update-size schedule (onlinespec.online.schedule): the first updates
    shift_scale: float = 1.0  # take this many times the learning rate and the steps


SETTINGS = [
    Setting("baseline"),
    Setting("lr 1e-4", lr=1e-4),
    Setting("1 epoch", epoch_cap=True),
    Setting("head rows", head_rows=True),
    Setting("hold-out positions", holdout="positions"),
    Setting("I = 25", interval=25),
    Setting("lr 1e-4 + 1 epoch + hold-out positions", lr=1e-4, epoch_cap=True, holdout="positions"),
    Setting("lr 5e-5", lr=5e-5),
    Setting("lr 1e-4 + 20 steps", lr=1e-4, steps=20),
    Setting("lr 1e-4 + I = 25", lr=1e-4, interval=25),
    Setting("next 10 hybrid", gate="next 10 hybrid", holdout="none"),
    Setting("next 10 hybrid + lr 5e-5", lr=5e-5, gate="next 10 hybrid", holdout="none"),
    Setting("next 20 hybrid + lr 5e-5", lr=5e-5, gate="next 20 hybrid", holdout="none"),
    # the update-size schedule (onlinespec.online.schedule), on the learner's defaults (I = 25, lr 5e-5, 40 steps,
    # the replayed gate's metric): "shift N xS" = the first N updates at S times the rate and the steps
    Setting("learner", interval=25, lr=5e-5, gate="holdout hybrid"),
    *(Setting(f"shift {n} x{scale:g}", interval=25, lr=5e-5, gate="holdout hybrid", shift_updates=n, shift_scale=scale)
      for n, scale in ((3, 2.0), (3, 4.0), (8, 2.0))),
]
NEXT_MAX = 20  # the next requests every candidate is scored on (the rules use the first 10 or all 20)


def alpha(scored) -> float:
    return sum(a for a, _ in scored) / max(1, sum(j for _, j in scored))


def gate_alpha(head, signal, starts: torch.Tensor) -> float:
    """Teacher-forced first-proposal agreement at ``starts`` (what the learner's gate measures)."""
    task = ChainTask(signal, ChainConfig(depth=1, generated_only=True))
    task.starts = starts
    with torch.inference_mode():
        _, logits, pos, valid = next(task.chain_outputs(head, starts, 1))
        hit = (head.vocab_ids[logits.argmax(-1)] == signal.top_ids[pos, 0]) & valid
    return float(hit.sum()) / max(1, int(valid.sum()))


def first_by_request(head, signal) -> list[tuple[int, int]]:
    """Per sequence, (first proposals that match the target, positions): teacher-forced, every generated position."""
    task = ChainTask(signal, ChainConfig(depth=1, generated_only=True))
    with torch.inference_mode():
        _, logits, pos, valid = next(task.chain_outputs(head, task.starts, 1))
        hit = (head.vocab_ids[logits.argmax(-1)] == signal.top_ids[pos, 0]) & valid
    seq = signal.sequence_of()[task.starts]
    hits = torch.zeros(len(signal), dtype=torch.long).index_add_(0, seq, hit.long())
    counts = torch.zeros(len(signal), dtype=torch.long).index_add_(0, seq, valid.long())
    return list(zip(hits.tolist(), counts.tolist()))


def hybrid_by_request(head, signal) -> list[tuple[int, int]]:
    return [tuple(x) for x in replay_acceptance(head, signal, HYBRID_REPLAY["k"], ngram=HYBRID_REPLAY["ngram"])]


def paired(before: list, after: list, draws: int = 2000) -> tuple[float, float]:
    """(alpha after - alpha before, its bootstrap standard error): requests resampled, pairs kept."""
    b, a = torch.tensor(before, dtype=torch.float64), torch.tensor(after, dtype=torch.float64)
    diff = float(a[:, 0].sum() / a[:, 1].sum().clamp(min=1) - b[:, 0].sum() / b[:, 1].sum().clamp(min=1))
    pick = torch.randint(len(b), (draws, len(b)), generator=torch.Generator().manual_seed(2))
    boot = a[pick, 0].sum(1) / a[pick, 1].sum(1).clamp(min=1) - b[pick, 0].sum(1) / b[pick, 1].sum(1).clamp(min=1)
    return diff, float(boot.std())


def _next(key: str, n: int, z: float | None = None):
    def rule(entry: dict) -> bool:
        before, after = (x[:n] for x in entry[key])
        diff, se = paired(before, after)
        return diff >= 0 if z is None else diff > z * se
    return rule


RULES = {
    "holdout first": lambda e: e["holdout_first"][1] >= e["holdout_first"][0] if e.get("holdout_first") else None,
    "holdout hybrid": lambda e: paired(*e["holdout_hybrid"])[0] >= 0 if e.get("holdout_hybrid") else None,
    "next 10 first": _next("next_first", 10),
    "next 20 first": _next("next_first", 20),
    "next 10 hybrid": _next("next_hybrid", 10),
    "next 20 hybrid": _next("next_hybrid", 20),
    "next 20 hybrid > -1 se": _next("next_hybrid", 20, -1.0),
    "next 20 hybrid > +1 se": _next("next_hybrid", 20, 1.0),
}


def judge(head, candidate, stream, held_starts, held_requests: list, next_signal, heldout) -> dict:
    """Every rule's raw figures for one candidate, and the truth per held-out request."""
    entry = {"truth_by_request": [hybrid_by_request(head, heldout), hybrid_by_request(candidate, heldout)],
             "next_first": [first_by_request(head, next_signal), first_by_request(candidate, next_signal)],
             "next_hybrid": [hybrid_by_request(head, next_signal), hybrid_by_request(candidate, next_signal)]}
    if len(held_starts):
        entry["holdout_first"] = [round(gate_alpha(head, stream, held_starts), 4), round(gate_alpha(candidate, stream, held_starts), 4)]
    if held_requests:
        held = stream.select(held_requests)
        entry["holdout_hybrid"] = [hybrid_by_request(head, held), hybrid_by_request(candidate, held)]
    return entry


def split_rows(setting: Setting, seen: int, seq_of, in_holdout, covered) -> tuple:
    """The positions the gate holds out and those the candidate trains on, of the first ``seen`` requests."""
    so_far = seq_of < seen
    if setting.holdout == "requests":
        cut = seen - max(1, round(0.2 * seen))
        held = so_far & (seq_of >= cut)
    elif setting.holdout == "positions":
        held = so_far & in_holdout
    else:
        held = torch.zeros_like(so_far)
    rows = so_far & ~held
    if covered is not None:
        rows &= ~covered
    return held, rows


def train_candidate(setting: Setting, head, optimizer, stream, starts, generator, plan: UpdatePlan) -> tuple:
    """A copy of ``head`` trained on ``starts`` (the optimizer state carried on) as ``plan`` says;
    (candidate, its optimizer)."""
    candidate = head.clone()
    opt = torch.optim.AdamW([p for p in candidate.parameters() if p.is_floating_point()], lr=plan.lr)
    if optimizer is not None:
        opt.load_state_dict(optimizer)
        for group in opt.param_groups:
            group["lr"] = plan.lr
    steps = plan.steps if not setting.epoch_cap else max(1, min(plan.steps, math.ceil(len(starts) / setting.batch)))
    task = ChainTask(stream, ChainConfig(generated_only=True))
    batches = (starts[torch.randint(len(starts), (min(setting.batch, len(starts)),), generator=generator)].tolist() for _ in range(steps))
    run_steps(candidate, opt, lambda model, o, chunk: task.step(model, o, chunk, DistillConfig()), batches)
    return candidate, opt


def run(setting: Setting, start_head, stream, heldout, gate_stream=None) -> dict:
    head = start_head.clone()
    optimizer = None
    generator = torch.Generator().manual_seed(0)
    n = len(stream)
    published = refused = 0
    gate_log = []
    full = ChainTask(stream, ChainConfig(generated_only=True))
    seq_of = stream.sequence_of()[full.starts]
    in_holdout = torch.rand(len(full.starts), generator=torch.Generator().manual_seed(1)) < 0.2
    covered = ngram_covered(stream, full.starts) if setting.head_rows else None
    schedule = UpdateSchedule(setting.lr, setting.steps, setting.lr, 1, setting.shift_updates, setting.shift_scale)
    for seen in range(setting.interval, n + 1, setting.interval):
        held, rows = split_rows(setting, seen, seq_of, in_holdout, covered)
        starts, held_starts = full.starts[rows], full.starts[held]
        plan = schedule.plan(cold=False)
        candidate, opt = train_candidate(setting, head, optimizer, stream, starts, generator, plan)
        schedule.done()
        if gate_stream is None:  # the original replay: the learner's gate only
            before, after = gate_alpha(head, stream, held_starts), gate_alpha(candidate, stream, held_starts)
            passed = after >= before
            truth_before = alpha(replay_acceptance(head, heldout, HYBRID_REPLAY["k"], ngram=HYBRID_REPLAY["ngram"]))
            truth_after = alpha(replay_acceptance(candidate, heldout, HYBRID_REPLAY["k"], ngram=HYBRID_REPLAY["ngram"]))
            gate_log.append({"seen": seen, "gate": [round(before, 4), round(after, 4)],
                             "truth": [round(truth_before, 4), round(truth_after, 4)], "published": passed})
        else:  # every rule in the shadow of the one that decides
            held_requests = sorted(set(seq_of[held].tolist())) if setting.holdout == "requests" else []
            next_signal = gate_stream.select(range(seen, min(seen + NEXT_MAX, len(gate_stream))))
            entry = judge(head, candidate, stream, held_starts, held_requests, next_signal, heldout)
            passed = bool(RULES[setting.gate](entry))
            entry.update(seen=seen, published=passed, lr=plan.lr, steps=plan.steps, truth=[round(alpha(x), 4) for x in entry["truth_by_request"]])
            entry["gate"] = entry.get("holdout_first") or [round(alpha(x[:10]), 4) for x in entry["next_hybrid"]]
            gate_log.append(entry)
        if passed:
            head, optimizer = candidate, opt.state_dict()
            published += 1
        else:
            refused += 1
    if gate_stream is None:
        agree = sum((g["gate"][1] >= g["gate"][0]) == (g["truth"][1] >= g["truth"][0]) for g in gate_log)
    else:
        agree = sum(g["published"] == (g["truth"][1] >= g["truth"][0]) for g in gate_log)
    return {"setting": setting.name, "gate_rule": setting.gate if gate_stream is not None else "holdout first", "published": published, "refused": refused,
            "heldout_hybrid_alpha": alpha(replay_acceptance(head, heldout, HYBRID_REPLAY["k"], ngram=HYBRID_REPLAY["ngram"])),
            "heldout_head_alpha": alpha(replay_acceptance(head, heldout, 4)),
            "candidates_that_helped": sum(g["truth"][1] > g["truth"][0] for g in gate_log),
            "gate_agrees_with_truth": agree, "updates": len(gate_log), "log": gate_log}


def analyse(results: list, packaged: dict) -> tuple[list, dict]:
    """(table lines, figures): per row, the deciding rule's agreement with the truth overall and on the
    decidable candidates (truth change beyond 1.96 bootstrap s.e.); per rule, the same over every
    candidate of every row."""
    per_rule = {name: [0, 0, 0, 0] for name in RULES}  # agreed, judged, agreed decidable, decidable
    rows, by_row = [], []
    for r in results:
        decidable = agreed = agreed_decidable = 0
        row_rules = {name: [0, 0, 0, 0] for name in RULES}
        for e in r["log"]:
            diff, se = paired(*e["truth_by_request"])
            e["truth_diff_se"] = [round(diff, 4), round(se, 4)]
            truth, sure = e["truth"][1] >= e["truth"][0], abs(diff) > 1.96 * se
            decidable += sure
            agreed += e["published"] == truth
            agreed_decidable += sure and e["published"] == truth
            for name, rule in RULES.items():
                verdict = rule(e)
                for tally in (per_rule[name], row_rules[name]) if verdict is not None else ():
                    tally[0] += verdict == truth
                    tally[1] += 1
                    tally[2] += sure and verdict == truth
                    tally[3] += sure
        # a gate that knew each candidate's real effect (taken as the measured change) would still disagree with
        # the 40-request truth with probability Phi(-|change| / s.e.): its expected agreement
        r["perfect_gate_expected"] = round(sum(0.5 * (1 + math.erf(abs(e["truth_diff_se"][0]) / max(e["truth_diff_se"][1], 1e-9) / math.sqrt(2)))
                                               for e in r["log"]), 1)
        ses = [e["truth_diff_se"][1] for e in r["log"]]
        diffs = [abs(e["truth_diff_se"][0]) for e in r["log"]]
        r.update(decidable=decidable, agreed_decidable=agreed_decidable, truth_se_median=sorted(ses)[len(ses) // 2],
                 truth_abs_change_median=sorted(diffs)[len(diffs) // 2])
        by_row += [f"| {r['setting']} | {name} | {t[0]} / {t[1]} | {t[2]} / {t[3]} |" for name, t in row_rules.items() if t[1]]
        rows.append(f"| {r['setting']} | {r['gate_rule']} | {r['published']} / {r['updates']} | {r['candidates_that_helped']} / {r['updates']} | "
                    f"{agreed} / {r['updates']} | {r['perfect_gate_expected']} | {agreed_decidable} / {decidable} | {r['truth_abs_change_median']:.4f} / {r['truth_se_median']:.4f} | "
                    f"{r['heldout_hybrid_alpha']:.3f} | {r['heldout_head_alpha']:.3f} |")
    lines = [
        (f"| row | gate that decides | published / candidates | candidates that helped (truth) | gate agreed with truth | a perfect gate's expected agreement | "
         f"agreed on decidable candidates | truth change / its s.e. (medians) | held-out hybrid alpha (packaged {packaged['hybrid']:.3f}) | "
         f"held-out head alpha (packaged {packaged['head']:.3f}) |"),
        "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
        "| rule (scored in the shadow of every row) | agreed with truth, all candidates | on decidable candidates |", "|---|---|---|",
        *(f"| {name} | {t[0]} / {t[1]} | {t[2]} / {t[3]} |" for name, t in per_rule.items() if t[1]), "",
        "| row | rule (on that row's candidates) | agreed with truth | on decidable candidates |", "|---|---|---|---|", *by_row,
    ]
    return lines, per_rule


def plot_served(results: list, packaged: dict, path: Path, title: str) -> None:
    """The truth (held-out hybrid alpha) of the draft that serves after each update, one line per row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        served = [packaged["hybrid"]]
        for e in r["log"]:
            served.append(e["truth"][1] if e["published"] else served[-1])
        ax.plot([0] + [e["seen"] for e in r["log"]], served, marker="o", label=r["setting"])
    ax.set_xlabel("requests learnt from")
    ax.set_ylabel("held-out hybrid alpha of the serving draft")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", default="stdlib")
    parser.add_argument("--stream", type=int, default=100, help="online-split requests learned from")
    parser.add_argument("--heldout", type=int, default=40, help="held-out-split requests the truth is measured on")
    parser.add_argument("--only", default=None, help="comma-separated setting names (default: all)")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "gate-experiments")
    parser.add_argument("--gates", action="store_true", help="score every candidate by every rule of RULES too (the next-requests gates)")
    parser.add_argument("--analyse", type=Path, default=None, help="a saved --gates JSON: print its tables (and with --plot its plot), run nothing")
    parser.add_argument("--plot", type=Path, default=None, help="also plot the serving draft's held-out alpha after each update (PNG)")
    args = parser.parse_args()
    if args.analyse is not None:
        saved = json.loads(args.analyse.read_text())
        print("\n".join(analyse(saved["results"], saved["packaged"])[0]))
        if args.plot:
            plot_served(saved["results"], saved["packaged"], args.plot, args.analyse.stem)
        return
    torch.manual_seed(0)
    target = load_model("default")
    pool = stream_pools([args.domain])[args.domain]
    config = SignalConfig(max_new_tokens=NEW_TOKENS)
    stream = build_signal(target.model, target.tokenizer, split(pool, "online")[: args.stream], config, cache_as="default")
    heldout = build_signal(target.model, target.tokenizer, split(pool, "heldout")[: args.heldout], config, cache_as="default")
    gate_stream = None
    if args.gates:  # the stream and NEXT_MAX requests after it: the last update has its next requests too
        tail = build_signal(target.model, target.tokenizer, split(pool, "online")[args.stream: args.stream + NEXT_MAX], config, cache_as="default")
        gate_stream = Signal.concat([stream, tail])
    start = load_head(DEFAULT_HEAD, target)
    packaged = {"hybrid": alpha(replay_acceptance(start, heldout, HYBRID_REPLAY["k"], ngram=HYBRID_REPLAY["ngram"])), "head": alpha(replay_acceptance(start, heldout, 4))}
    chosen = [s for s in SETTINGS if args.only is None or s.name in args.only.split(",")]
    results = []
    for setting in chosen:
        began = time.time()
        results.append(run(setting, start, stream, heldout, gate_stream))
        r = results[-1]
        print(f"{setting.name}: published {r['published']}/{r['updates']}, held-out hybrid alpha {packaged['hybrid']:.3f} -> "
              f"{r['heldout_hybrid_alpha']:.3f}, head {packaged['head']:.3f} -> {r['heldout_head_alpha']:.3f}, "
              f"gate agreed with the truth {r['gate_agrees_with_truth']}/{r['updates']} ({time.time() - began:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shadow = analyse(results, packaged)[0] if args.gates else []
    harness.write_result(args.out.with_suffix(".json"), {"packaged": packaged, "results": results}, indent=None if args.gates else 1)
    lines = [
        (f"| hypothesis (one change from baseline) | published / candidates | candidates that helped (truth) | gate agreed with truth | "
        f"held-out hybrid alpha (packaged {packaged['hybrid']:.3f}) | held-out head alpha (packaged {packaged['head']:.3f}) |"),
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['setting']} | {r['published']} / {r['updates']} | {r['candidates_that_helped']} / {r['updates']} | "
                     f"{r['gate_agrees_with_truth']} / {r['updates']} | {r['heldout_hybrid_alpha']:.3f} | {r['heldout_head_alpha']:.3f} |")
    if shadow:
        lines += ["", *shadow]
    header = (f"Command: `python bench/gate_experiments.py --domain {args.domain} --stream {args.stream} --heldout {args.heldout}"
              f"{' --gates' if args.gates else ''}{f' --only {chr(34)}{args.only}{chr(34)}' if args.only else ''}`; "
              f"{platform.platform()}, {harness.utc_now()}.")
    if args.plot:
        plot_served(results, packaged, args.plot, f"{args.domain}: the serving draft after each update")
    args.out.with_suffix(".md").write_text(header + "\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
