"""Bulk warm-up: distil a feature head on millions of the target's own tokens, on one accelerator.

The CPU recipe (:mod:`onlinespec.drafts.warmup`) decodes about 600k tokens in some 25 minutes on
two cores; the draft it makes is limited by that data. This recipe runs the same steps at scale,
in two commands:

1. ``export`` (wherever the data packages are installed): tokenise every warm-up query (chat
   template applied; a long prompt keeps its last tokens) and the held-out evaluation prompts into
   one gzipped JSON bundle, with the target's config. The accelerator machine then needs neither a
   tokenizer nor the data sets, only the target's GGUF file.
2. ``run``: load the target from the GGUF file, decode its answers to each job (greedy, then
   sampled continuations for variety), score every sequence teacher-forced to get the target's
   post-norm features and top-K distributions (a :class:`~onlinespec.distill.signal.Signal`, kept
   on the device), pick the restricted vocabulary, distil each head design by the multi-step chain
   objective (:mod:`onlinespec.drafts.train`), score the heads on the held-out prompts and save
   them. Every phase has a deadline, so a lease of fixed length still returns finished heads.

Only warm-up-split queries are decoded for training (the online stream and the held-out prompts
never are); the held-out prompts are decoded only to score the heads. ``run --smoke`` runs the
whole path on a tiny random target in seconds (the tests use it).

    python -m onlinespec.drafts.bulk export --out bundle.json.gz
    python -m onlinespec.drafts.bulk run --bundle bundle.json.gz --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out heads/
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from onlinespec.decoding.feature_head import CHAIN_DEPTH, HEAD_VOCAB, FeatureHead, frequent_vocab
from onlinespec.distill.loop import run_steps
from onlinespec.distill.signal import Signal
from onlinespec.distill.step import DistillConfig
from onlinespec.distill.trainer import TrainConfig
from onlinespec.drafts.bulk_decode import Job, decode, score
from onlinespec.drafts.gguf_target import build_target, llama_state_dict_from_gguf
from onlinespec.drafts.train import ChainConfig, ChainTask, evaluate_chain

BUNDLE_VERSION = 1


# --------------------------------------------------------------------------------------------
# The jobs: which warm-up queries, decoded how


def export_bundle(out: str | Path, max_prompt_tokens: int = 256, max_new_tokens: int = 256, seed: int = 0, heldout_per_domain: int = 20) -> dict:
    """Write the bundle ``run`` reads (see the module docstring); returns a summary of its jobs."""
    from onlinespec.data.sources import available_gsm_languages, english_pools, load_gsm_symbolic, packaged_prompts
    from onlinespec.data.splits import split, split_of
    from onlinespec.models import default_target_dir, load_model, tokenizer_fingerprint
    from onlinespec.tokens import encode_prompt, eos_token_ids

    target = load_model("default")
    tokenizer = target.tokenizer

    def encode(queries):
        return [encode_prompt(tokenizer, list(q.messages) if q.messages else q.prompt)[-max_prompt_tokens:] for q in queries]

    pools = english_pools(["chat", "code", "math"])
    warm = {d: split(pools[d], "warmup") for d in pools}
    for d, pool in warm.items():
        random.Random(f"{seed}:{d}").shuffle(pool)
    math_ml = [
        q for lang in available_gsm_languages() if lang not in ("eng", "eng_metric")
        for q in load_gsm_symbolic(lang) if split_of(q.id.replace(f"/{lang}/", "/eng/")) == "warmup"
    ]
    # (name, queries, temperature, samples), in priority order: a deadline cuts the tail
    plan = [
        ("chat", warm["chat"], 0.0, 1),
        ("code", warm["code"], 0.0, 1),
        ("math", warm["math"], 0.0, 1),
        ("code-sampled", warm["code"], 0.8, 3),
        ("math-sampled", warm["math"], 0.7, 8),
        ("math-multilingual", math_ml, 0.0, 1),
        ("chat-sampled", warm["chat"], 0.8, 1),
    ]
    jobs = []
    for name, queries, temperature, samples in plan:
        jobs.append({
            "name": name, "temperature": temperature, "samples": samples, "max_new_tokens": max_new_tokens,
            "prompts": encode(queries), "domains": [q.domain for q in queries], "query_ids": [q.id for q in queries],
        })
    heldout = packaged_prompts(3 * heldout_per_domain, ("chat", "code", "math"), seed=0, split="heldout")
    bundle = {
        "version": BUNDLE_VERSION,
        "target": target.name,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "config": json.loads((default_target_dir() / "config.json").read_text()),
        "eos_ids": sorted(eos_token_ids(target.model, tokenizer)),
        "pad_id": int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id),
        "jobs": jobs,
        "heldout": {
            "name": "heldout", "temperature": 0.0, "samples": 1, "max_new_tokens": 64,
            "prompts": encode(heldout), "domains": [q.domain for q in heldout], "query_ids": [q.id for q in heldout],
        },
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with gzip.open(tmp, "wt") as handle:
        json.dump(bundle, handle)
    tmp.replace(out)
    return {j["name"]: len(j["prompts"]) * j["samples"] for j in jobs} | {"heldout": len(heldout)}


def _shrunk(job: Job, n: int) -> Job:
    """The smoke run's version of a job: its first ``n`` prompts, 8 new tokens, 2 samples at most."""
    return dataclasses.replace(job, prompts=job.prompts[:n], domains=job.domains[:n], query_ids=job.query_ids[:n],
                               max_new_tokens=8, samples=min(job.samples, 2))


def _job(spec: dict) -> Job:
    return Job(spec["name"], float(spec["temperature"]), int(spec["samples"]), int(spec["max_new_tokens"]),
               spec["prompts"], spec["domains"], spec["query_ids"])


# --------------------------------------------------------------------------------------------
# Training


@dataclass(frozen=True)
class HeadDesign:
    name: str
    intermediate_size: int = 1024
    num_blocks: int = 2
    save_dtype: str = "float32"  # float16 halves the file (the default draft must stay <= 20 MB)


@dataclass(frozen=True)
class BulkRecipe:
    vocab_size: int = HEAD_VOCAB
    depth: int = CHAIN_DEPTH
    step_decay: float = 0.8
    batch_size: int = 1024
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 200
    max_steps: int = 40000  # the deadline usually ends training first
    loss: str = "fkl"
    seed: int = 0


def train_head(model, signal: Signal, vocab: torch.Tensor, design: HeadDesign, recipe: BulkRecipe, deadline: float, log=print) -> tuple[FeatureHead, dict]:
    """Distil one head on ``signal`` until ``recipe.max_steps`` or ``deadline``. The cosine
    schedule's length is set from the measured step time, so the lr has decayed when time is up."""
    torch.manual_seed(recipe.seed)
    device = signal.ids.device
    head = FeatureHead.for_target(model, vocab.cpu(), intermediate_size=design.intermediate_size, num_blocks=design.num_blocks).to(device)
    task = ChainTask(signal, ChainConfig(depth=recipe.depth, step_decay=recipe.step_decay))
    distill = DistillConfig(loss=recipe.loss)
    optimizer = torch.optim.AdamW(head.parameters(), lr=recipe.lr, weight_decay=0.0)
    generator = torch.Generator(device=device).manual_seed(recipe.seed)
    schedule = TrainConfig(recipe.max_steps, lr=recipe.lr, warmup_steps=recipe.warmup_steps, min_lr_ratio=recipe.min_lr_ratio)
    total, losses, started = [recipe.max_steps], [], time.monotonic()

    def batches():
        step = 0
        while step < total[0] and not (time.monotonic() > deadline and step >= 100):
            yield task.starts[torch.randint(len(task.starts), (recipe.batch_size,), device=device, generator=generator)]
            step += 1

    def lr_at(step: int) -> float:
        return dataclasses.replace(schedule, steps=total[0]).lr_at(step)

    def after_step(i: int, loss: float) -> None:
        step = i + 1
        if step == 50:  # measure, then fit the schedule into the time left
            per_step = (time.monotonic() - started) / 50
            total[0] = max(100, min(recipe.max_steps, int((deadline - started) / per_step)))
            log(f"  {design.name}: {per_step * 1e3:.1f} ms/step -> {total[0]} steps")
        if step % 2000 == 0 or step == total[0]:
            losses.append(round(loss, 4))
            log(f"  {design.name}: step {step}/{total[0]} loss {losses[-1]} lr {lr_at(i):.2e} ({time.monotonic() - started:.0f} s)")

    step = len(run_steps(head, optimizer, lambda model, opt, batch: task.step(model, opt, batch, distill), batches(), lr_at, after_step=after_step))
    return head, {"steps": step, "seconds": round(time.monotonic() - started, 1), "losses": losses, "examples": step * recipe.batch_size}


# --------------------------------------------------------------------------------------------
# The whole run


DEFAULT_DESIGNS = (HeadDesign("head-2x1024", save_dtype="float16"), HeadDesign("head-3x1536", 1536, 3, "float16"))


def run(bundle_path: str | Path, gguf: str | Path | None, out: str | Path, seconds: float = 480.0, designs=DEFAULT_DESIGNS,
        recipe: BulkRecipe = BulkRecipe(), device: str | None = None, smoke: bool = False, log=print) -> dict:
    """Decode, score, train and save (see the module docstring); ``seconds`` bounds the whole run."""
    begin = time.monotonic()
    at = lambda fraction: begin + fraction * seconds  # noqa: E731
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_float32_matmul_precision("high")  # TF32 on GPUs that have it: features to ~1e-3, 4-8x faster
    bundle = _read_bundle(bundle_path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config, model = _load_target(bundle["config"], gguf, smoke, device)
    log(f"target on {device} in {time.monotonic() - begin:.0f} s")
    sequences, made, heldout_sequences = _decode_jobs(model, bundle, smoke, at(0.40), log)
    t0 = time.monotonic()
    signal = score(model, sequences, token_budget=4096 if smoke else 131072)
    heldout = score(model, heldout_sequences, token_budget=4096 if smoke else 131072).to("cpu")
    log(f"scored {signal.n_tokens:,} tokens in {time.monotonic() - t0:.0f} s")
    _save_tokens(out / "tokens.npz", sequences, log)
    counts = torch.bincount(signal.ids, minlength=config["vocab_size"]).cpu()
    vocab = frequent_vocab(counts, recipe.vocab_size, always=bundle["eos_ids"])
    summary = {
        "target": bundle["target"], "tokenizer": bundle["tokenizer"], "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "decoded": made, "tokens": signal.n_tokens, "sequences": len(signal), "recipe": dataclasses.asdict(recipe), "heads": {},
    }
    provenance = {"target": bundle["target"], "tokenizer": bundle["tokenizer"], "dtype": "torch.float32",
                  "data": {"recipe": "bulk", "tokens": signal.n_tokens, "sequences": len(signal), "jobs": made}}
    share = (0.93 - (time.monotonic() - begin) / seconds) / len(designs)
    for n, design in enumerate(designs):
        deadline = at(1 - share * (len(designs) - n - 1) - 0.07)
        summary["heads"][design.name] = _train_and_save(model, signal, heldout, vocab, design, recipe, deadline,
                                                        out / design.name, provenance, log)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log(f"done in {time.monotonic() - begin:.0f} s")
    return summary


def _read_bundle(path: str | Path) -> dict:
    """The exported bundle, refused if another version of this code wrote it."""
    with gzip.open(path, "rt") as handle:
        bundle = json.load(handle)
    if bundle.get("version") != BUNDLE_VERSION:
        raise ValueError(f"{path} is a bundle of version {bundle.get('version')}; this code reads version {BUNDLE_VERSION}: export it again")
    return bundle


def _load_target(config: dict, gguf: str | Path | None, smoke: bool, device: str) -> tuple[dict, torch.nn.Module]:
    """The target from its GGUF file, or (``smoke``) a tiny random one; with the config it was built from."""
    if smoke:
        config = smoke_config(config)
        torch.manual_seed(0)
        return config, build_target(config, None, device)
    if gguf is None:
        raise ValueError("run needs --gguf, the target's GGUF file (or --smoke)")
    return config, build_target(config, llama_state_dict_from_gguf(gguf, config), device)


def _decode_jobs(model, bundle: dict, smoke: bool, deadline: float, log=print) -> tuple[list, dict, list]:
    """The target's sequences for every training job (until ``deadline``), what each job made,
    and the held-out job's sequences (all of them: the heads are scored on the same prompts)."""
    budget, rows = (4096, 8) if smoke else (1 << 20, 2048)
    jobs, heldout_job = [_job(j) for j in bundle["jobs"]], _job(bundle["heldout"])
    if smoke:
        jobs, heldout_job = [_shrunk(j, 3) for j in jobs], _shrunk(heldout_job, 6)
    sequences, made = [], {}
    for job in jobs:
        t0 = time.monotonic()
        part = decode(model, job, bundle["eos_ids"], bundle["pad_id"], budget, rows, deadline, log)
        sequences += part
        made[job.name] = {"sequences": len(part), "tokens": sum(len(s) - p for s, p, _, _ in part), "seconds": round(time.monotonic() - t0, 1)}
        log(f"decoded {job.name}: {made[job.name]}")
    heldout = decode(model, heldout_job, bundle["eos_ids"], bundle["pad_id"], budget, rows, float("inf"), log)
    return sequences, made, heldout


def _train_and_save(model, signal: Signal, heldout: Signal, vocab: torch.Tensor, design: HeadDesign, recipe: BulkRecipe,
                    deadline: float, folder: Path, provenance: dict, log=print) -> dict:
    """Train one head design, score it on the held-out signal and save it to ``folder``; its
    summary. A design whose training raises is reported, and the run goes on to the next."""
    try:
        head, report = train_head(model, signal, vocab, design, recipe, deadline, log)
    except Exception as error:
        log(f"{design.name}: training failed: {error!r}")
        return {"error": repr(error)}
    head = head.cpu()
    evaluation = evaluate_chain(head, heldout, depth=recipe.depth)
    meta = {**provenance, "recipe": {**dataclasses.asdict(recipe), **dataclasses.asdict(design)}, "train": report, "heldout": evaluation}
    saved = head.clone()
    if design.save_dtype == "float16":
        saved = saved.half()
    saved.save(folder, meta)
    log(f"{design.name}: held-out step acceptance " + ", ".join(f"{d} {e['step_acceptance']}" for d, e in evaluation.items()))
    return {"train": report, "heldout": evaluation}


def smoke_config(config: dict) -> dict:
    """A tiny random target with the same vocabulary: ``run --smoke`` checks the whole path in seconds."""
    return {**config, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _save_tokens(path: Path, sequences, log=print, limit: int = 15 << 20) -> None:
    """The decoded sequences as compact ids (to rebuild the signal elsewhere without decoding)."""
    import numpy as np

    ids = np.array([t for s, _, _, _ in sequences for t in s], dtype=np.uint16)
    lengths = np.array([len(s) for s, _, _, _ in sequences], dtype=np.int32)
    prompt_lens = np.array([p for _, p, _, _ in sequences], dtype=np.int32)
    meta = np.array(json.dumps([[d, q] for _, _, d, q in sequences]))
    np.savez_compressed(path, ids=ids, lengths=lengths, prompt_lens=prompt_lens, meta=meta)
    if path.stat().st_size > limit:
        log(f"tokens file is {path.stat().st_size >> 20} MB: dropped (over {limit >> 20} MB)")
        path.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onlinespec.drafts.bulk", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="tokenise the warm-up and held-out queries into a bundle")
    exp.add_argument("--out", required=True)
    exp.add_argument("--max-new-tokens", type=int, default=256)
    go = sub.add_parser("run", help="decode, score, train and save heads")
    go.add_argument("--bundle", required=True)
    go.add_argument("--gguf")
    go.add_argument("--out", required=True)
    go.add_argument("--seconds", type=float, default=480.0, help="wall-clock budget for the whole run")
    go.add_argument("--device")
    go.add_argument("--smoke", action="store_true", help="a tiny random target: checks the path in seconds")
    args = parser.parse_args(argv)
    if args.command == "export":
        print(json.dumps(export_bundle(args.out, max_new_tokens=args.max_new_tokens), indent=2))
        return 0
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    recipe = BulkRecipe(batch_size=32, warmup_steps=10) if args.smoke else BulkRecipe()
    designs = tuple(dataclasses.replace(d, intermediate_size=64) for d in DEFAULT_DESIGNS) if args.smoke else DEFAULT_DESIGNS
    run(args.bundle, args.gguf, args.out, args.seconds, designs, recipe, args.device, args.smoke, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
