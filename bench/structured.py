"""Structured output on real JSON schemas: speculation against the target alone under the same constraint.

The schemas are ones nobody here wrote, chosen before measuring (docs/engine.md lists them):
the 26 that check-jsonschema 0.39.0 vendors from SchemaStore (``check_jsonschema/builtin_schemas/vendor``:
``pip download --no-deps check-jsonschema==0.39.0`` and unzip it, or install it), then those
installed packages of the lock ship (jsonschema-specifications' draft 4-2020-12 metaschemas,
setuptools' two, ray's autoscaler). A schema llguidance refuses is reported with its message,
never dropped silently.

For each schema and each mode (greedy; sampled, temperature 0.7, seeded), the default target
(llama.cpp on a CPU) writes a JSON document for it ("Write a JSON document valid against the
schema titled ..."), alone and with the default speculation (hybrid draft, k = 4, adaptive k);
tokens/s of both (forced tokens count as tokens), greedy identity, and for every output that
ends by itself (finish ``eos``/stop) whether it parses and validates with ``jsonschema``; the
share cut by ``max_tokens``.

    python bench/structured.py --schemas /tmp/cj/check_jsonschema/builtin_schemas/vendor   # ~30-60 min on 2 cores
    python bench/structured.py --schemas DIR --limit 5 --max-tokens 96                   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

VENDOR = ["azure-pipelines", "bamboo-spec", "bitbucket-pipelines", "buildkite", "changie", "circle-ci", "citation-file-format",
          "cloudbuild", "codecov", "compose-spec", "dependabot", "drone-ci", "github-actions", "github-discussion",
          "github-issue-config", "github-issue-forms", "github-workflows", "gitlab-ci", "meltano", "mergify", "readthedocs",
          "renovate", "snapcraft", "taskfile", "travis", "woodpecker-ci"]
INSTALLED = ["jsonschema_specifications/schemas/draft4/metaschema.json", "jsonschema_specifications/schemas/draft6/metaschema.json",
             "jsonschema_specifications/schemas/draft7/metaschema.json", "jsonschema_specifications/schemas/draft201909/metaschema.json",
             "jsonschema_specifications/schemas/draft202012/metaschema.json", "setuptools/config/setuptools.schema.json",
             "setuptools/config/distutils.schema.json", "ray/autoscaler/ray-schema.json"]


def schema_files(folder: str | None) -> list[Path]:
    """The chosen schemas that exist here, in the fixed order above."""
    files = []
    if folder is None:
        try:
            import check_jsonschema
            folder = str(Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor")
        except ImportError:
            print("check-jsonschema's schemas not given (--schemas) nor installed: the installed packages' only", file=sys.stderr)
    if folder:
        files += [Path(folder) / f"{name}.json" for name in VENDOR if (Path(folder) / f"{name}.json").exists()]
    site = next(p for p in sys.path if p.endswith("site-packages"))
    files += [Path(site) / rel for rel in INSTALLED if (Path(site) / rel).exists()]
    return files


def prompt(schema: dict, name: str) -> list[dict]:
    title = schema.get("title") or name
    return [{"role": "user", "content": f"Write a short JSON document valid against the JSON schema titled {title!r}. Answer with the JSON only."}]


def run(decoder, messages, params) -> dict:
    tick = time.perf_counter()
    g = decoder.generate(messages, params)
    return {"ids": g.token_ids, "text": g.text, "finish": g.stats.finish_reason, "tokens": g.stats.new_tokens,
            "seconds": time.perf_counter() - tick, "forced": g.stats.by_drafter.get("grammar", [0, 0])[0]}


def check(text: str, schema: dict) -> str:
    import jsonschema
    try:
        document = json.loads(text)
    except ValueError:
        return "unparsed"
    try:
        jsonschema.validate(document, schema)
    except jsonschema.ValidationError:
        return "invalid"
    except jsonschema.SchemaError:
        return "schema-error"
    return "valid"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--schemas", help="check-jsonschema's vendored schemas (builtin_schemas/vendor); default: the installed package's")
    parser.add_argument("--limit", type=int, default=0, help="the first N schemas only (0: all)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", default="bench/results/structured.json")
    args = parser.parse_args()

    from onlinespec.benchmark import machine_info
    from onlinespec.decoding.grammar import Constraint, GrammarError, compile_constraint
    from onlinespec.decoding.sampling import SamplingParams
    from onlinespec.factory import engine_options, make_proposer, new_decoder
    from onlinespec.models import load_target

    target = load_target("default")
    alone = new_decoder(target, None, 0)
    options = engine_options(target, 4, adaptive=True)
    spec = new_decoder(target, make_proposer("hybrid", target).proposer, 4, options)
    rows, refused = [], {}
    files = schema_files(args.schemas)[: args.limit or None]
    for path in files:
        schema = json.loads(path.read_text())
        try:  # a schema past the size limit is refused as it is built, one past llguidance's as it compiles
            constraint = Constraint.json_schema(schema)
            compile_constraint(constraint, target.tokenizer, alone.eos_token_ids)
        except GrammarError as err:
            refused[path.name] = str(err)[:300]
            print(f"refused {path.name}: {str(err)[:120]}", flush=True)
            continue
        for mode, temperature in (("greedy", 0.0), ("sampled", 0.7)):
            params = SamplingParams(max_new_tokens=args.max_tokens, temperature=temperature, seed=1 if temperature else None, constraint=constraint)
            a, s = run(alone, prompt(schema, path.stem), params), run(spec, prompt(schema, path.stem), params)
            row = {"schema": path.name, "mode": mode, "alone": a, "spec": s, "identical": a["ids"] == s["ids"] if mode == "greedy" else None,
                   "checks": [check(r["text"], schema) if r["finish"] == "eos" else "cut" for r in (a, s)]}
            rows.append(row)
            print(f"{path.name:32s} {mode:7s} alone {a['tokens'] / a['seconds']:6.1f} tok/s  spec {s['tokens'] / s['seconds']:6.1f} tok/s  "
                  f"forced {s['forced']:3d}  {row['checks']}  identical {row['identical']}", flush=True)
    summary = summarise(rows, refused, len(files))
    summary["forced_bound"] = forced_bound(rows, files, target.tokenizer, alone.eos_token_ids,
                                           options["cost_curve"].seconds[(1, 64)], 4)
    summary.update(command="python bench/structured.py " + " ".join(sys.argv[1:]), machine=machine_info(),
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


def forced_bound(rows: list[dict], files: list[Path], tokenizer, eos, curve: list[float], k: int) -> dict:
    """What forced tokens alone could give on this machine's verify-cost curve (one request, 64
    cached tokens): each greedy output of the target alone replayed through its grammar, a round of
    ``w`` forced tokens (at most ``k``) and the token after them costing ``curve[w]``, every other
    token one step. The speedup of a perfect jump-forward with no draft, against the target alone."""
    from onlinespec.decoding.grammar import Constraint, compile_constraint

    by_name = {path.name: path for path in files}
    steps = spent = 0.0
    tokens, runs = 0, []
    for row in (r for r in rows if r["mode"] == "greedy"):
        matcher = compile_constraint(Constraint.json_schema(json.loads(by_name[row["schema"]].read_text())), tokenizer, eos)
        ids, i = row["alone"]["ids"], 0
        while i < len(ids):
            ahead, n = matcher.compute_ff_tokens()[:k], 0
            while n < len(ahead) and i + n < len(ids) and ids[i + n] == ahead[n]:
                n += 1
            for token in ids[i: i + n + 1]:
                matcher.consume_token(token)
            spent += curve[min(n, len(curve) - 1)]
            runs += [n] if n else []
            i += n + 1
        steps += len(ids) * curve[0]
        tokens += len(ids)
    return {"greedy_tokens": tokens, "forced_tokens": sum(runs),
            "forced_runs": len(runs), "mean_run": sum(runs) / len(runs) if runs else 0.0, "curve_ms": [round(c * 1000, 2) for c in curve],
            "speedup_bound": steps / spent if spent else 1.0}


def summarise(rows: list[dict], refused: dict, chosen: int) -> dict:
    alone = sum(r["alone"]["tokens"] for r in rows) / max(sum(r["alone"]["seconds"] for r in rows), 1e-9)
    spec = sum(r["spec"]["tokens"] for r in rows) / max(sum(r["spec"]["seconds"] for r in rows), 1e-9)
    checks = [c for r in rows for c in r["checks"]]
    by_mode = {}
    for mode in ("greedy", "sampled"):
        mine = [r for r in rows if r["mode"] == mode]
        a = sum(r["alone"]["tokens"] for r in mine) / max(sum(r["alone"]["seconds"] for r in mine), 1e-9)
        s = sum(r["spec"]["tokens"] for r in mine) / max(sum(r["spec"]["seconds"] for r in mine), 1e-9)
        by_mode[mode] = s / a if a else 0.0
    summary = {"schemas": chosen, "compiled": chosen - len(refused), "refused": refused, "alone_tokens_per_s": alone,
               "spec_tokens_per_s": spec, "speedup": spec / alone if alone else 0, "speedup_by_mode": by_mode,
               "forced_tokens": sum(r["spec"]["forced"] for r in rows), "spec_tokens": sum(r["spec"]["tokens"] for r in rows),
               "greedy_identical": sum(bool(r["identical"]) for r in rows if r["mode"] == "greedy"),
               "greedy_runs": sum(r["mode"] == "greedy" for r in rows),
               "ended": {c: checks.count(c) for c in ("valid", "invalid", "unparsed", "schema-error")}, "cut_by_max_tokens": checks.count("cut"),
               "outputs": len(checks)}
    return summary


if __name__ == "__main__":
    main()
