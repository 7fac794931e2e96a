"""Does the online draft catch up with a draft distilled offline on 100% of a domain's data?
(arXiv 2310.07177, section 5, Figures 3 and 4, on the default draft).

The stream: the first N requests of each domain of the experiments' abrupt stream (code ->
math_ml -> chat, online split; ``bench/online_experiments.py``), served live by the default draft
(n-gram lookup + the packaged head) with one draft per domain learning online, k = 4 fixed (so
replay is exact), 64 new tokens, the learner as in the demo (every 10 requests, lowest priority).

The references: the packaged head distilled offline on the target's answers to N requests of the
same domain, in two ways:

- held out: N requests of the domain's WARM-UP split, never served in the stream. This is how the
  paper's Table 1 drafts are scored (distilled on a data set's training split, measured on other
  prompts), and what a team could deploy before the traffic arrives.
- in-sample: the stream's own N requests of the domain, scored on those same requests. On
  answers of 64 tokens it recites what it memorised (``docs/online-experiments.md``): an upper
  bound no draft that serves a request before learning from it can reach.

Each is scored by replaying speculative decoding over the target's greedy answers to the stream
(a test shows replay equals a live fixed-k run), as served (hybrid) and with the head alone; the
online draft's head alone is replayed with the version that served each request.

    python bench/online_reference.py [N]      # N = 200: ~35 min on 2 CPU cores; stages cached
    python bench/online_reference.py 300 --domains math_ml --cpu-share 0.3 --name online-reference-maths300

``--cpu-share S`` runs the learner at normal priority for at most a share S of the wall time
(faster updates, at a serving cost) instead of the demo's lowest OS priority.

Writes docs/results/NAME.md, docs/results/NAME.png and docs/results/NAME.json (NAME: ``--name``, default online-reference).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from online_experiments import DOMAIN_ORDER, NEW_TOKENS, K, pools, serve_cached, streams, teacher_signal

DOCS = harness.RESULTS
WORK = harness.RUNS / "online-reference"
NGRAM = (3, 2)  # the default hybrid's n-gram lookup (max, min)
WINDOW = 50  # moving average, as the paper plots alpha
TOLERANCE = 0.05
LEARNER = {"update_interval": 10, "position_policy": "verified"}  # the demo's learner; the rest are defaults
REFERENCE_LR, REFERENCE_EPOCHS = 3e-4, 2


def reference(target, signal, name: str) -> Path:
    """The packaged head distilled offline on ``signal`` (cached under WORK/name)."""
    import torch

    from onlinespec.distill.step import DistillConfig
    from onlinespec.distill.trainer import TrainConfig, Trainer
    from onlinespec.drafts.train import ChainConfig, ChainTask
    from onlinespec.factory import DEFAULT_HEAD, load_head

    out = WORK / f"{name}-{len(signal)}"
    if (out / "feature_head.json").exists():
        return out
    torch.manual_seed(0)
    head = load_head(DEFAULT_HEAD, target)
    task = ChainTask(signal, ChainConfig(generated_only=True))
    steps = max(100, round(REFERENCE_EPOCHS * len(task) / 64))
    config = TrainConfig(steps=steps, batch_size=64, lr=REFERENCE_LR, warmup_steps=20, checkpoint_every=500, distill=DistillConfig("fkl"))
    Trainer(head, task.starts.tolist(), WORK / f"{name}-{len(signal)}.work", config, step_fn=task.step).run()
    head.save(out, {"trained_on": f"{len(signal)} answers of {sorted(set(signal.domains))}", "steps": steps})
    return out


def live_run(queries: list, name: str, learner: dict) -> dict:
    """Serve the stream with the online system (cached in WORK/live-NAME/result.json)."""
    from onlinespec.online.learner import LearnerConfig
    from onlinespec.serve.config import CoreConfig
    from onlinespec.stream import OnlineConfig

    config = OnlineConfig(CoreConfig(k=K, adaptive_k=False, learner=LearnerConfig(**learner)), max_new_tokens=NEW_TOKENS)
    return serve_cached(WORK / f"live-{name}", "live", queries, config)


def moving_average(scored: list[tuple[int, int]]) -> list[float]:
    """Per request, the mean per-request alpha over the last WINDOW requests (the live rows' figure)."""
    alphas = [a / j if j else 0.0 for a, j in scored]
    return [sum(alphas[max(0, i + 1 - WINDOW): i + 1]) / len(alphas[max(0, i + 1 - WINDOW): i + 1]) for i in range(len(alphas))]


def catch_up(online: list[float], ref: list[float]) -> int | None:
    """The first request from which the online moving average stays within TOLERANCE of the reference's."""
    for i in range(len(online)):
        if all(o >= r - TOLERANCE for o, r in zip(online[i:], ref[i:])):
            return i
    return None


def main() -> None:
    import torch

    from onlinespec.models import load_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("per_domain", type=int, nargs="?", default=200, help="requests per domain segment")
    parser.add_argument("--domains", default=",".join(DOMAIN_ORDER), help="segments to serve, from " + ",".join(DOMAIN_ORDER))
    parser.add_argument("--cpu-share", type=float, default=None, help="learner at normal priority with this wall-time share")
    parser.add_argument("--name", default="online-reference", help="output name under docs/results/")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if args.report_only:
        report(json.loads((DOCS / f"{args.name}.json").read_text()), args.name)
        return
    per_domain, domains = args.per_domain, [d for d in DOMAIN_ORDER if d in args.domains.split(",")]
    learner = dict(LEARNER, **({"priority": "normal", "cpu_share": args.cpu_share} if args.cpu_share else {}))
    WORK.mkdir(parents=True, exist_ok=True)
    target = load_model("default", "float32")
    abrupt = streams(target.tokenizer)[0]
    signal = teacher_signal(target, abrupt)
    keep = {d: [i for i, q in enumerate(abrupt) if q.domain == d][:per_domain] for d in domains}
    queries = [abrupt[i] for d in domains for i in keep[d]]
    # a shuffled sample: the pools keep their sources' order (math_ml, for one, language by language)
    warmup = {d: random.Random(f"warmup:{d}").sample(pool, per_domain) for d, pool in pools(target.tokenizer, "warmup").items() if d in domains}
    print("references: distilling on each domain's warm-up answers (held out) and on the stream's own (in-sample)", flush=True)
    refs = {}
    for d in domains:
        refs[d] = {"held out": reference(target, teacher_signal(target, warmup[d]), f"ref-heldout-{d}"),
                   "in-sample": reference(target, signal.select(keep[d]), f"ref-insample-{d}")}
    live = live_run(queries, args.name, learner)
    rows = live["requests"]
    results = {"settings": {"command": shlex.join(["python", "bench/online_reference.py", *sys.argv[1:]]),
                            "per_domain": per_domain, "k": K, "new_tokens": NEW_TOKENS, "ngram": NGRAM, "learner": learner,
                            "reference": {"lr": REFERENCE_LR, "epochs": REFERENCE_EPOCHS}, "window": WINDOW,
                            "date": time.strftime("%Y-%m-%d"), "torch_threads": torch.get_num_threads()},
               "domains": {}}
    for d in domains:
        results["domains"][d] = score_domain(target, signal.select(keep[d]), [r for r in rows if r["domain"] == d], refs[d],
                                             WORK / f"live-{args.name}" / "run" / "drafts" / d)
    harness.write_result(DOCS / f"{args.name}.json", results, command=["python", "bench/online_reference.py", *sys.argv[1:]])
    report(results, args.name)


def score_domain(target, segment, live_rows: list[dict], refs: dict, drafts_dir: Path) -> dict:
    """One domain's curves, alpha, last-50 and catch-up, as served (hybrid) and for the head alone:
    the packaged head, the references, and the online draft (live, and its versions replayed)."""
    from onlinespec.drafts.train import replay_acceptance
    from onlinespec.factory import DEFAULT_HEAD, load_head
    from onlinespec.online.registry import DraftRegistry
    from onlinespec.weights import load_weights

    assert [r["id"] for r in live_rows] == segment.query_ids, "the live stream and the cached answers must be the same requests"
    heads = {"static (packaged)": load_head(DEFAULT_HEAD, target)}
    heads.update({f"{kind} 100%": load_head(path, target) for kind, path in refs.items()})
    scored = {"hybrid": {name: replay_acceptance(h, segment, K, ngram=NGRAM) for name, h in heads.items()},
              "head": {name: replay_acceptance(h, segment, K) for name, h in heads.items()}}
    # the online head alone: each request replayed with the version that served it
    registry, online_head = DraftRegistry(drafts_dir), [None] * len(live_rows)
    for version in sorted({r["draft_version"] for r in live_rows}):
        head = load_head(DEFAULT_HEAD, target)
        load_weights(head, registry.load(version), f"{version} of {registry.directory}")
        picks = [i for i, r in enumerate(live_rows) if r["draft_version"] == version]
        for i, s in zip(picks, replay_acceptance(head.eval(), segment.select(picks), K)):
            online_head[i] = s
    scored["hybrid"]["online (live)"] = [(r["accepted"], r["judged"]) for r in live_rows]
    scored["head"]["online (live versions, replayed)"] = online_head
    out = {}
    for view, drafts in scored.items():
        curves = {name: moving_average(s) for name, s in drafts.items()}
        online_name = next(n for n in curves if n.startswith("online"))
        out[view] = {
            "curves": curves,
            "alpha": {name: sum(a for a, _ in s) / max(1, sum(j for _, j in s)) for name, s in drafts.items()},
            "last_50": {name: c[-1] for name, c in curves.items()},
            "catch_up": {ref: catch_up(curves[online_name], curves[ref]) for ref in curves if "100%" in ref},
        }
    out["versions"] = sorted({r["draft_version"] for r in live_rows})
    return out


def report(results: dict, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = results["settings"]
    lines = ["# Online draft vs drafts distilled offline on 100% of a domain's data", "",
             (f"Command: `{s.get('command', 'python bench/online_reference.py ' + str(s['per_domain']))}` ({s['date']}, 2 CPU "
             f"cores, fp32 target SmolLM2-135M-Instruct). Stream: the first {s['per_domain']} requests of each domain "
             f"({' -> '.join(results['domains'])}) of the experiments' abrupt stream, served live by the default draft (n-gram lookup + packaged head), "
             f"one draft per domain learning online (`{s['learner']}`, the rest defaults), greedy, k = {s['k']} fixed, "
             f"{s['new_tokens']} new tokens."), "",
             (f"References: the packaged head distilled offline (lr {s['reference']['lr']}, {s['reference']['epochs']} epochs) "
             f"on the target's answers to {s['per_domain']} requests of the domain: **held out** (the domain's warm-up split, "
             "never served: how the paper's Table 1 drafts are scored) and **in-sample** (the stream's own requests, scored on "
             "them: it recites answers it memorised, a bound no online draft can reach, since it serves each request before "
             "learning from it). They are scored by replaying speculative decoding over the target's answers to the stream."), "",
             (f"alpha: accepted over judged proposals. Curves: moving average of per-request alpha over the last {WINDOW} "
             f"requests of the segment. Catch-up: the first request of the segment from which the online moving average "
             f"stays within {TOLERANCE} of the reference's (0: from the start)."), ""]
    for view, title in (("hybrid", "As served (n-gram lookup + head)"), ("head", "The head alone (where the drafts differ)")):
        lines += [f"## {title}", "", "| domain | draft | alpha (segment) | moving average, last 50 | online catch-up |", "|---|---|---|---|---|"]
        for d, out in results["domains"].items():
            for draft, alpha in out[view]["alpha"].items():
                cu = out[view]["catch_up"].get(draft, "")
                cu = "" if draft not in out[view]["catch_up"] else ("not reached" if cu is None else f"request {cu}")
                lines.append(f"| {d} | {draft} | {alpha:.3f} | {out[view]['last_50'][draft]:.3f} | {cu} |")
        lines.append("")
    fig, axes = plt.subplots(2, len(results["domains"]), figsize=(5 * len(results["domains"]), 7), squeeze=False)
    for col, (d, out) in enumerate(results["domains"].items()):
        for row, view in enumerate(("hybrid", "head")):
            ax = axes[row][col]
            for draft, curve in out[view]["curves"].items():
                ax.plot(range(1, len(curve) + 1), curve, label=draft, lw=2 if draft.startswith("online") else 1)
            ax.set_title(f"{d}: {'as served' if view == 'hybrid' else 'head alone'}")
            ax.set_xlabel("request of the segment")
            ax.set_ylabel(f"alpha (moving average, {WINDOW})")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(textwrap.fill(s.get("command", ""), 40 * len(results["domains"])), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(DOCS / f"{name}.png", dpi=110)
    lines += [f"![online vs references]({name}.png)", ""]
    (DOCS / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
