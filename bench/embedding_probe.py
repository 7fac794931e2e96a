"""Which prompt embedding tells the domains apart (docs/routing.md, "Embedding").

60 online-split prompts per domain (code, maths in 23 languages, chat) through the default
target's prefill; four poolings of its post-norm states (``last``: the last position, used by the
content router; ``mean``; ``cat``: mean and last concatenated; ``last4``: the last four). Per
domain: centroids of 30 prompts, the other 30 classified by nearest centroid; the accuracy and
the cosine distances to their own and to the nearest other centroid::

    python bench/embedding_probe.py
"""

from __future__ import annotations

import random

import torch

from onlinespec.data.sources import stream_pools
from onlinespec.data.splits import split
from onlinespec.models import load_model
from onlinespec.tokens import encode_prompt

unit = torch.nn.functional.normalize


def embeddings(model, query) -> dict[str, torch.Tensor]:
    ids = encode_prompt(model.tokenizer, list(query.messages) if query.messages else query.prompt)[-256:]
    with torch.inference_mode():
        h = model.model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
    return {"cat": unit(torch.cat([unit(h.sum(0), dim=0), unit(h[-1], dim=0)]), dim=0), "last": unit(h[-1], dim=0),
            "mean": unit(h.mean(0), dim=0), "last4": unit(h[-4:].mean(0), dim=0)}


def main() -> None:
    model = load_model("default")
    pools = stream_pools(["code", "math_ml", "chat"])
    rng = random.Random(0)
    found = {d: [embeddings(model, q) for q in rng.sample(split(p, "online"), 60)] for d, p in pools.items()}
    for name in ("cat", "last", "mean", "last4"):
        vectors = {d: torch.stack([e[name] for e in rows]) for d, rows in found.items()}
        centroids = {d: unit(v[:30].mean(0), dim=0) for d, v in vectors.items()}
        print(name)
        for d, v in vectors.items():
            own = 1 - v[30:] @ centroids[d]
            other = torch.stack([1 - v[30:] @ centroids[o] for o in centroids if o != d]).min(0).values
            print(f"  {d}: own q50/q90/max {own.quantile(0.5):.3f}/{own.quantile(0.9):.3f}/{own.max():.3f}  "
                  f"nearest other q05/q50 {other.quantile(0.05):.3f}/{other.quantile(0.5):.3f}  "
                  f"accuracy {(own < other).float().mean():.2f}")


if __name__ == "__main__":
    main()
