"""Tool calls through the `openai` client (issue 48, "Must show"): on 20 held-out prompts, one
`onlinespec serve` on the packaged default target and draft (127.0.0.1, bounded, stops by itself).

Three tools, written here (a user's tools are part of their request, not of the model):
`calculate` (an expression), `search_docs` (a query and a result count, 1-10) and `get_weather`
(a city and a unit, celsius or fahrenheit). For each prompt (the `heldout` split's chat, code and
maths prompts in turn, the first 20), greedy:

* `tool_choice: "required"`: the answer must be tool calls; each call's name must be an offered
  tool and its arguments must parse and validate against that tool's parameter schema
  (`jsonschema`);
* `tool_choice` naming `search_docs`: the same, and every call must be `search_docs`;
* `tool_choice: "auto"`: how often the model called a tool, and whether every call parsed and
  validated (a 135M model mostly answers in prose: the figure is what it is);
* a conversation that continues after a call: the `required` answer's calls, each answered by a
  `role: "tool"` message, then `tool_choice: "none"`: the server must answer with content.

    python bench/tool_calls.py                      # 20 prompts (~5 min on 2 cores)
    python bench/tool_calls.py --n 5 --out runs/tool_calls.json
    # a target whose chat template has its own tool format (hermes: `make qwen-target` prints its path)
    python bench/tool_calls.py --out docs/results/tool_calls_qwen1.5b.json --server-args --target QWEN.gguf

Writes JSON (docs/results/tool_calls.json by default); docs/serve.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

TOOLS = [
    {"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression.",
                                      "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 200}},
                                                     "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_docs", "description": "Search the documentation for pages about a topic.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 200},
                                                                                      "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                                                     "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 80},
                                                                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                     "required": ["city", "unit"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MAX_TOKENS = 160


def prompts(n: int) -> list[dict]:
    path = harness.RUNS / "tool_calls" / "heldout.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "onlinespec.cli", "data", "export", "--n", str(n), "--out", str(path), "--split", "heldout"],
                   check=True, capture_output=True)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]


def check_calls(calls, only: str | None = None) -> dict:
    """Whether every call names an offered tool (``only``: that one), and its arguments parse and validate."""
    found = []
    for call in calls or []:
        name, ok, why = call.function.name, True, ""
        try:
            args = json.loads(call.function.arguments)
            if name not in SCHEMAS or (only and name != only):
                ok, why = False, f"tool {name!r} not offered" if name not in SCHEMAS else f"{name!r} is not {only!r}"
            else:
                jsonschema.validate(args, SCHEMAS[name])
        except (json.JSONDecodeError, jsonschema.ValidationError) as err:
            ok, why = False, str(err).splitlines()[0][:200]
        found.append({"name": name, "arguments": call.function.arguments, "valid": ok, "why": why})
    return {"calls": found, "all_valid": bool(found) and all(c["valid"] for c in found)}


def ask(api, model: str, messages: list[dict], choice) -> tuple[object, float]:
    start = time.perf_counter()
    answer = api.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice, temperature=0.0,
                                         max_tokens=MAX_TOKENS)
    return answer.choices[0], time.perf_counter() - start


def one_prompt(api, model: str, query: dict) -> dict:
    messages = query["messages"]
    row = {"id": query["id"], "domain": query["domain"]}
    required, row["required_s"] = ask(api, model, messages, "required")
    row["required"] = {"finish_reason": required.finish_reason, **check_calls(required.message.tool_calls)}
    named, row["named_s"] = ask(api, model, messages, {"type": "function", "function": {"name": "search_docs"}})
    row["named"] = {"finish_reason": named.finish_reason, **check_calls(named.message.tool_calls, only="search_docs")}
    auto, row["auto_s"] = ask(api, model, messages, "auto")
    row["auto"] = {"finish_reason": auto.finish_reason, "called": bool(auto.message.tool_calls), **check_calls(auto.message.tool_calls)}
    if required.message.tool_calls:  # the conversation goes on: each call answered by a tool message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                 for c in required.message.tool_calls]
        turn = [*messages, {"role": "assistant", "content": None, "tool_calls": calls},
                *({"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"result": "42"})} for c in calls)]
        after, _ = ask(api, model, turn, "none")
        row["continued"] = {"finish_reason": after.finish_reason, "content": (after.message.content or "")[:200],
                            "ok": bool(after.message.content) and not after.message.tool_calls}
    return row


def summarize(rows: list[dict]) -> dict:
    n = len(rows)
    return {"prompts": n,
            "required_all_valid": sum(r["required"]["all_valid"] for r in rows),
            "named_all_valid": sum(r["named"]["all_valid"] for r in rows),
            "required_cut_by_max_tokens": sum(r["required"]["finish_reason"] == "length" for r in rows),
            "auto_called": sum(r["auto"]["called"] for r in rows),
            "auto_calls_all_valid": sum(r["auto"]["all_valid"] for r in rows if r["auto"]["called"]),
            "continued_with_content": sum(r.get("continued", {}).get("ok", False) for r in rows),
            "continued_tried": sum("continued" in r for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "tool_calls.json")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="more `onlinespec serve` flags, e.g. --target <a GGUF whose template has a tool format>")
    args = parser.parse_args()
    queries = prompts(args.n)
    rows = []
    with harness.serve_onlinespec(["--out-dir", str(harness.RUNS / "tool_calls" / "run"), "--static", *args.server_args]) as url:
        api = harness.client(url)
        model = api.models.list().data[0].id
        for i, query in enumerate(queries):
            rows.append(one_prompt(api, model, query))
            r = rows[-1]
            print(f"[{i + 1}/{len(queries)}] {r['domain']:5} required valid {r['required']['all_valid']}  named valid {r['named']['all_valid']}"
                  f"  auto called {r['auto']['called']}  continued {r.get('continued', {}).get('ok')}", flush=True)
    summary = summarize(rows)
    harness.write_result(args.out, {"summary": summary, "max_tokens": MAX_TOKENS, "tools": TOOLS, "server_args": args.server_args, "rows": rows})
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
