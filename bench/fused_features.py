"""Does the head draft better from a fusion of low, middle and high target layers (EAGLE-3)?

EAGLE-3 (Li et al., 2025, arXiv 2503.01840) feeds its draft head the target's hidden states from a
low, a middle and a high layer, fused by a linear layer, instead of the last layer alone. Here:
the packaged head, fine-tuned two ways on the same data for the same steps:

- ``last``: as served today, from the target's post-norm last hidden state;
- ``fused``: from ``f_last + W [norm(h_low); norm(h_mid)]``, ``W`` learned and starting at zero
  (so the fused head starts as the packaged one), RMS-normed states of layers ``--low`` and ``--mid``.

Only a round's first step reads the target's state; later steps read the head's own output, as
in serving. Both are scored by replaying greedy speculative decoding exactly (k = 4, head alone
and the hybrid with n-gram lookup) on held-out requests, against the packaged head::

    python bench/fused_features.py --train 300 --heldout 60 --steps 400 --out docs/results/fused-features

Training data: the target's greedy answers to warm-up-split chat and code requests; held out: the
default bench's 60 held-out chat, code and maths prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

from onlinespec.data.sources import packaged_prompts
from onlinespec.decoding.feature_head import RMSNorm
from onlinespec.distill.loop import run_steps
from onlinespec.distill.signal import SignalConfig, build_signal
from onlinespec.distill.step import DistillConfig
from onlinespec.drafts.train import ChainConfig, ChainTask, replay_acceptance
from onlinespec.factory import DEFAULT_HEAD, load_head
from onlinespec.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness


class Fusion(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm_low, self.norm_mid = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, last: torch.Tensor, low: torch.Tensor, mid: torch.Tensor) -> torch.Tensor:
        return last + self.proj(torch.cat([self.norm_low(low), self.norm_mid(mid)], -1))


class FusedTask(ChainTask):
    """A chain task whose starting features are fused from three layers (the fusion trains too)."""

    def __init__(self, signal, low: torch.Tensor, mid: torch.Tensor, fusion: Fusion, chain: ChainConfig) -> None:
        super().__init__(signal, chain)
        self.low, self.mid, self.fusion = low, mid, fusion

    def chain_outputs(self, head, starts, depth=None):
        depth = depth or self.chain.depth
        s = self.signal
        feature = self.fusion(s.features[starts].float(), self.low[starts].float(), self.mid[starts].float())
        for j in range(1, depth + 1):
            pos = (starts + j).clamp_max(s.n_tokens - 1)
            valid = starts + j < self.end[starts]
            feature = head.step(feature, s.ids[pos])
            yield j, head.logits(feature), pos, valid


@torch.inference_mode()
def layer_states(target, signal, layers: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] hidden states of two layers at every token of ``signal`` (teacher forced, one sequence at a time)."""
    out = [[], []]
    for i in range(len(signal)):
        ids = signal.ids[int(signal.starts[i]): int(signal.starts[i + 1])][None]
        states = target.model.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
        for slot, layer in enumerate(layers):
            out[slot].append(states[layer][0].half())
    return torch.cat(out[0]), torch.cat(out[1])


def alpha(scored) -> float:
    return sum(a for a, _ in scored) / max(1, sum(j for _, j in scored))


def fused_signal(signal, low, mid, fusion):
    with torch.inference_mode():
        features = fusion(signal.features.float(), low.float(), mid.float()).half()
    return dataclasses.replace(signal, features=features)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=300, help="warm-up-split requests (chat, code, maths) to fine-tune on")
    parser.add_argument("--heldout", type=int, default=60)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--low", type=int, default=3, help="the low layer (hidden_states index: 0 is the embeddings)")
    parser.add_argument("--mid", type=int, default=15)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "fused-features")
    args = parser.parse_args()
    torch.manual_seed(0)
    target = load_model("default")
    config = SignalConfig(max_new_tokens=64)
    # chat and code only: the English maths pool has too few warm-up problems for a few hundred requests
    train_queries = packaged_prompts(args.train, domains=("chat", "code"), split="warmup", seed=7)
    train = build_signal(target.model, target.tokenizer, train_queries, config, cache_as="default")
    heldout = build_signal(target.model, target.tokenizer, packaged_prompts(args.heldout, split="heldout"), config, cache_as="default")
    layers = (args.low, args.mid)
    train_low, train_mid = layer_states(target, train, layers)
    held_low, held_mid = layer_states(target, heldout, layers)
    packaged = load_head(DEFAULT_HEAD, target)
    scores = {"packaged": {"head": alpha(replay_acceptance(packaged, heldout, 4)),
                           "hybrid": alpha(replay_acceptance(packaged, heldout, 4, ngram=(3, 2)))}}
    chain = ChainConfig(generated_only=True)
    for arm in ("last", "fused"):
        began = time.time()
        head = packaged.clone()
        generator = torch.Generator().manual_seed(0)
        if arm == "last":
            task, params = ChainTask(train, chain), list(head.parameters())
        else:
            fusion = Fusion(target.model.config.hidden_size, target.model.config.rms_norm_eps)
            task = FusedTask(train, train_low, train_mid, fusion, chain)
            params = list(head.parameters()) + list(fusion.parameters())
        optimizer = torch.optim.AdamW([p for p in params if p.is_floating_point() and p.requires_grad], lr=args.lr)
        starts = task.starts
        batches = (starts[torch.randint(len(starts), (args.batch,), generator=generator)].tolist() for _ in range(args.steps))
        run_steps(head, optimizer, lambda model, opt, chunk, task=task: task.step(model, opt, chunk, DistillConfig()), batches)
        scored = heldout if arm == "last" else fused_signal(heldout, held_low, held_mid, fusion)
        scores[arm] = {"head": alpha(replay_acceptance(head, scored, 4)), "hybrid": alpha(replay_acceptance(head, scored, 4, ngram=(3, 2))),
                       "seconds": time.time() - began}
        print(arm, scores[arm], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = (f"python bench/fused_features.py --train {args.train} --heldout {args.heldout} --steps {args.steps} "
               f"--batch {args.batch} --lr {args.lr} --low {args.low} --mid {args.mid}")
    lines = [
        f"Command: `{command}`. Machine: {platform.platform()}. Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Fine-tuned on {len(train)} warm-up requests ({train.n_tokens} tokens), scored on {len(heldout)} held-out requests.", "",
        "| head | held-out alpha, head alone (k = 4 replay) | held-out alpha, hybrid |", "|---|---|---|",
    ]
    for arm, s in scores.items():
        lines.append(f"| {arm} | {s['head']:.3f} | {s['hybrid']:.3f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    harness.write_result(args.out.with_suffix(".json"), {"scores": scores})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
