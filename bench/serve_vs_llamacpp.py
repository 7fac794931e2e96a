"""Serving at several requests in flight: `onlinespec serve` against llama-cpp-python's own
OpenAI server, on the same GGUF file and the same held-out requests, through the real `openai`
client on 127.0.0.1.

- `onlinespec`: `onlinespec serve` on the packaged default (the llama.cpp backend, the default
  hybrid draft kept static, batched engine with --max-batch at the highest level);
- `onlinespec alone`: the same server with `--draft none` (the target alone, batched);
- `llama_cpp.server`: `python -m llama_cpp.server` on the same GGUF, 2 threads, n_ctx 4096,
  `--interrupt_requests False` (its default cancels the request in flight when another arrives).
  It serves one request at a time (its settings have no parallel slots); repeat penalty off so it
  computes what the others do.

Streamed, greedy, 48 new tokens at most; the levels run one after the other per server, the
servers one after the other in the order given (run twice in the other order to see drift).
Needs `pip install 'llama-cpp-python[server]'` (sse-starlette, starlette-context, pydantic-settings).

    python bench/serve_vs_llamacpp.py --n 48 --levels 1,4,8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import held_out, run_level, send  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"


def wait_ready(url: str, seconds: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {seconds} s")


def start(name: str, port: int, work: Path, max_batch: int, n: int, max_tokens: int) -> tuple[subprocess.Popen, str]:
    from onlinespec.decoding.runners.llamacpp import cpu_threads
    from onlinespec.models import default_gguf_path

    log = open(work / f"{name}.log", "w")
    if name == "llama_cpp.server":
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_gguf_path()), "--host", "127.0.0.1",
                   "--port", str(port), "--n_threads", str(cpu_threads()), "--n_threads_batch", str(cpu_threads()),
                   "--n_ctx", "4096", "--n_batch", "512",
                   # its default (True) cancels the request in flight whenever a new one arrives:
                   # at 4 in flight every stream but the last came back empty, with status 200
                   "--interrupt_requests", "False"]
        ready = f"http://127.0.0.1:{port}/v1/models"
    else:
        extra = ["--static"] if name == "onlinespec" else ["--draft", "none"]
        command = [sys.executable, "-m", "onlinespec.cli", "serve", *extra, "--out-dir", str(work / name), "--port", str(port),
                   "--max-batch", str(max_batch), "--max-waiting", str(n), "--default-max-tokens", str(max_tokens)]
        ready = f"http://127.0.0.1:{port}/ready"
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    wait_ready(ready)
    return process, f"http://127.0.0.1:{port}/v1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--servers", default="onlinespec,llama_cpp.server,onlinespec alone")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "serve-vs-llamacpp")
    parser.add_argument("--out", type=Path, default=DOCS / "serve-vs-llamacpp.json")
    args = parser.parse_args()
    import openai

    from onlinespec.benchmark import machine_info

    levels = [int(n) for n in args.levels.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    queries = held_out(args.n)
    result = {"command": " ".join(["python", "bench/serve_vs_llamacpp.py", *sys.argv[1:]]), "machine": machine_info(),
              "n_requests": len(queries), "max_tokens": args.max_tokens, "servers": {}}
    for port, name in enumerate(args.servers.split(","), start=8301):
        process, url = start(name, port, args.work, max(levels), len(queries), args.max_tokens)
        try:
            client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=900)
            model = client.models.list().data[0].id
            extra = {"repeat_penalty": 1.0} if name == "llama_cpp.server" else None  # what the others compute
            for q in queries[:3]:
                send(client, model, q, 8, extra)
            figures = {}
            for n in levels:
                figures[n] = run_level(client, model, queries, args.max_tokens, n, extra)
                f = figures[n]
                print(f"[{name}] {n} in flight: {f['tokens_per_s']:.1f} tok/s, p50 {f['latency_p50_s']:.2f} s, "
                      f"TTFT p50 {f['ttft_p50_s']:.3f} s, errors {f['errors']}", flush=True)
            result["servers"][name] = figures
        finally:
            process.terminate()
            process.wait(60)
    # llama_cpp.server sends no usage in its streams: every server's tokens are counted the same
    # way, by tokenizing the text it streamed with the target's tokenizer
    from transformers import AutoTokenizer

    from onlinespec.models import default_target_dir

    tokenizer = AutoTokenizer.from_pretrained(str(default_target_dir()))
    texts = {name: {n: f.pop("texts") for n, f in figures.items()} for name, figures in result["servers"].items()}
    (args.work / f"{args.out.stem}-texts.json").write_text(json.dumps(texts))
    for name, figures in result["servers"].items():
        for n, f in figures.items():
            f["tokens_retokenized"] = sum(len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts[name][n].values())
            f["tokens_per_s_retokenized"] = f["tokens_retokenized"] / f["wall_s"]
    for name, figures in result["servers"].items():
        for n, f in figures.items():
            base = result["servers"].get("llama_cpp.server", {}).get(n)
            f["ratio_vs_llama_cpp_server"] = f["tokens_per_s_retokenized"] / base["tokens_per_s_retokenized"] if base else None
        same = texts.get("onlinespec alone", {})
        if name != "onlinespec alone" and same:
            for n in figures:
                figures[n]["same_text_as_onlinespec_alone"] = sum(texts[name][n][k] == same[n].get(k) for k in texts[name][n])
    args.out.write_text(json.dumps(result, indent=1))
    for name, figures in result["servers"].items():
        print(name, {n: (round(f["tokens_per_s_retokenized"], 1), f["ratio_vs_llama_cpp_server"]) for n, f in figures.items()})


if __name__ == "__main__":
    main()
