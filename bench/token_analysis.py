"""Which tokens online learning taught the draft (arXiv 2310.07177, section 5.5).

For a draft head before and after online learning on one domain, on held-out requests of that
domain: the target's greedy answers (teacher forced), and at every generated position the head's
first proposal (its argmax from the target's feature there). Per token ``x`` of the 100 most
frequent in the target's answers:

- precision: of the positions where the head proposed ``x``, the share where the target wrote ``x``;
- recall: of the positions where the target wrote ``x``, the share where the head proposed ``x``.

Writes a Markdown table (all 100 tokens, sorted by recall gain) and a PNG (recall and precision
before vs after, the tokens that gained most named)::

    python bench/token_analysis.py --registry runs/stdlib300-learn/drafts/stdlib --domain stdlib \
        --out docs/results/token-analysis
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

from onlinespec.data.sources import stream_pools
from onlinespec.data.splits import split
from onlinespec.distill.signal import SignalConfig, build_signal
from onlinespec.drafts.train import ChainConfig, ChainTask
from onlinespec.factory import DEFAULT_HEAD, load_head
from onlinespec.models import load_model
from onlinespec.online.registry import DraftRegistry
from onlinespec.weights import load_weights


@torch.inference_mode()
def first_proposals(head, signal) -> tuple[torch.Tensor, torch.Tensor]:
    """(target token, head's argmax) at every generated position of ``signal``."""
    task = ChainTask(signal, ChainConfig(depth=1, generated_only=True))
    wrote, proposed = [], []
    for first in range(0, len(task.starts), 2048):
        starts = task.starts[first: first + 2048]
        for _, logits, pos, valid in task.chain_outputs(head, starts, 1):
            wrote.append(signal.top_ids[pos, 0][valid])
            proposed.append(head.vocab_ids[logits.argmax(-1)][valid])
    return torch.cat(wrote), torch.cat(proposed)


def per_token(wrote: torch.Tensor, proposed: torch.Tensor, tokens: list[int]) -> dict[int, dict]:
    hit = wrote == proposed
    out = {}
    for x in tokens:
        proposed_x, wrote_x = proposed == x, wrote == x
        correct = int((hit & wrote_x).sum())
        out[x] = {"precision": correct / max(1, int(proposed_x.sum())), "recall": correct / max(1, int(wrote_x.sum())),
                  "proposed": int(proposed_x.sum()), "count": int(wrote_x.sum())}
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    fig, axes = harness.figure(1, 2, figsize=(12, 5.5))
    for ax, key in zip(axes, ("recall", "precision")):
        before = [r[f"{key}_before"] for r in rows]
        after = [r[f"{key}_after"] for r in rows]
        sizes = [max(8, 400 * r["count"] / rows[0]["count"]) for r in rows]
        ax.scatter(before, after, s=sizes, alpha=0.5)
        ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--")
        for r in sorted(rows, key=lambda r: r[f"{key}_after"] - r[f"{key}_before"], reverse=True)[:10]:
            ax.annotate(repr(r["text"]), (r[f"{key}_before"], r[f"{key}_after"]), fontsize=8)
        ax.set_xlabel(f"{key} before online learning")
        ax.set_ylabel(f"{key} after")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{key}, 100 most frequent target tokens (size: frequency)")
    fig.suptitle(title)
    harness.save(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", type=Path, required=True, help="the draft's registry folder (drafts/<name>) of an online run")
    parser.add_argument("--version", default=None, help="the version learned online (default: CURRENT)")
    parser.add_argument("--domain", required=True, help="the domain it learned (its held-out split is evaluated)")
    parser.add_argument("--n", type=int, default=80, help="held-out requests")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("docs/results/token-analysis"))
    args = parser.parse_args()

    target = load_model("default")
    before = load_head(DEFAULT_HEAD, target)
    registry = DraftRegistry(args.registry)
    version = args.version or registry.current()
    after = before.clone()
    load_weights(after, registry.load(version), f"{args.registry}/{version}")
    queries = split(stream_pools([args.domain])[args.domain], "heldout")[: args.n]
    signal = build_signal(target.model, target.tokenizer, queries, SignalConfig(max_new_tokens=args.max_new_tokens),
                          cache_as="default")
    wrote, proposed_before = first_proposals(before, signal)
    _, proposed_after = first_proposals(after, signal)
    frequent = [x for x, _ in Counter(wrote.tolist()).most_common(args.top)]
    share = float(sum(int((wrote == x).sum()) for x in frequent)) / len(wrote)
    b, a = per_token(wrote, proposed_before, frequent), per_token(wrote, proposed_after, frequent)
    rows = [{"token": x, "text": target.tokenizer.decode([x]), "count": b[x]["count"],
             "precision_before": b[x]["precision"], "precision_after": a[x]["precision"],
             "recall_before": b[x]["recall"], "recall_after": a[x]["recall"]} for x in frequent]
    overall = {"agreement_before": float((wrote == proposed_before).float().mean()),
               "agreement_after": float((wrote == proposed_after).float().mean())}
    gained_recall = sum(r["recall_after"] > r["recall_before"] for r in rows)
    gained_precision = sum(r["precision_after"] > r["precision_before"] for r in rows)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    title = f"{args.domain}: the packaged head vs {version} learned online ({len(queries)} held-out requests)"
    plot(rows, args.out.with_suffix(".png"), title)
    command = "python bench/token_analysis.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None)
    lines = [
        f"# Token analysis: what online learning taught the draft ({args.domain})", "",
        (f"Command: `{command}`. Machine: {platform.platform()}, {torch.get_num_threads()} torch threads. "
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."), "",
        (f"{len(queries)} held-out `{args.domain}` requests (never served while learning), the target's greedy answers "
        f"({len(wrote)} generated positions), teacher forced; per token, the head's first proposal from the target's "
        f"feature (arXiv 2310.07177, section 5.5). The {args.top} most frequent target tokens are {share:.1%} of all "
        f"generated tokens. Before: the packaged head; after: `{version}` of `{args.registry}`."), "",
        (f"- First-proposal agreement over all positions: {overall['agreement_before']:.3f} before, "
        f"{overall['agreement_after']:.3f} after."),
        f"- Recall rose on {gained_recall} of the {args.top} tokens, precision on {gained_precision}.", "",
        "![token analysis](" + args.out.with_suffix(".png").name + ")", "",
        "| token | count | recall before | recall after | precision before | precision after |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["recall_after"] - r["recall_before"], reverse=True):
        lines.append(f"| `{json.dumps(r['text'])[1:-1].replace('|', '&#124;')}` | {r['count']} | {r['recall_before']:.2f} | "
                     f"{r['recall_after']:.2f} | {r['precision_before']:.2f} | {r['precision_after']:.2f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    harness.write_result(args.out.with_suffix(".json"), {"overall": overall, "share_top": share, "rows": rows})
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}: agreement "
          f"{overall['agreement_before']:.3f} -> {overall['agreement_after']:.3f}")


if __name__ == "__main__":
    main()
