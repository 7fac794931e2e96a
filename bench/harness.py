"""What the bench/ scripts share: where a figure was measured, writing it, starting the servers
measured, ordering runs so that drift falls on every configuration alike, timing a streamed
request, and plotting. bench/README.md lists the scripts and the doc pages they feed.

    import harness
    with harness.serve_onlinespec(["--static"]) as url, harness.serve_llama_server(gguf, parallel=4) as base:
        for item, name in harness.interleave(prompts, ["onlinespec", "llama-server"]):
            timing = harness.stream_chat(url if name == "onlinespec" else base, item.messages, 64)
    harness.write_result(harness.RESULTS / "x.json", {"rows": rows})

Nothing here loads a model; the onlinespec imports are deferred so that `--help` stays cheap.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"  # figures and JSON that docs/*.md quote
RUNS = ROOT / "runs"  # work files, never committed
LLAMA_SERVER_ENV = "ONLINESPEC_LLAMA_SERVER"
LLAMA_SERVER_DEFAULT = Path.home() / ".cache" / "onlinespec" / "bin" / "llama-server"


# ------------------------------------------------------------------------------------------------
# Where and when: every result JSON carries both
# ------------------------------------------------------------------------------------------------


def machine() -> dict:
    """CPU model, cores, RAM, OS, Python, torch and llama-cpp-python versions, git commit, UTC date
    (:func:`onlinespec.benchmark.machine_info`, the one mechanism `onlinespec bench` uses too)."""
    from onlinespec.benchmark import machine_info

    return machine_info()


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def write_result(path: str | Path, payload: dict, command: Sequence[str] | None = None, indent: int | None = 1) -> Path:
    """Write ``payload`` as JSON at ``path`` (parent folders made) with "command" (the command
    line that produced it: ``python`` and ``sys.argv`` unless given), "machine" and "date" added.
    Keys the payload already has win, so a ``--report-only`` rewrite keeps the measured run's."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = shlex.join(command) if command is not None else shlex.join(["python", *sys.argv])
    record = {"command": line, "date": utc_now(), "machine": payload.get("machine") or machine(), **payload}
    path.write_text(json.dumps(record, indent=indent, default=str) + "\n")
    return path


# ------------------------------------------------------------------------------------------------
# Servers: started on a free port of 127.0.0.1, ready when entered, stopped when left
# ------------------------------------------------------------------------------------------------


def free_port() -> int:
    from onlinespec.serve.server import free_port as free

    return free()


def log_tail(path: str | Path | None, lines: int = 30) -> str:
    if not path or not Path(path).exists():
        return "(no log)"
    text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    return f"last {len(text)} lines of {path}:\n" + "\n".join(text)


def _log_file(log_path, name: str) -> Path:
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        return Path(log_path)
    handle, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
    os.close(handle)
    return Path(path)


class Served(str):
    """A started server's base URL ("http://127.0.0.1:PORT"), with its child ``process`` (for the
    pid, or a SIGSTOP between blocks) and its ``log`` file."""

    process: subprocess.Popen
    log: Path

    def __new__(cls, url: str, process: subprocess.Popen, log: Path) -> Self:
        served = super().__new__(cls, url)
        served.process, served.log = process, log
        return served


@contextlib.contextmanager
def serve_onlinespec(args: Sequence[str], port: int | None = None, env: dict | None = None, ready_timeout: float = 900,
                     log_path: str | Path | None = None) -> Iterator[Served]:
    """``onlinespec serve ARGS --host 127.0.0.1 --port PORT`` (a free port unless given) in a child
    process; yields its base URL (a :class:`Served`) once GET /ready answers 200. ``env`` is added to this process's
    environment. Fails with the server's log tail if it exits or is not ready in time; on leaving,
    SIGTERM (a graceful drain) and SIGKILL after two minutes (:class:`onlinespec.serve.server.ServerProcess`)."""
    from onlinespec.serve.server import ServerProcess

    log = _log_file(log_path, "onlinespec-serve")
    server = ServerProcess(list(args), port=port, log=log, env={**os.environ, **(env or {})}, ready_timeout=ready_timeout)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as error:
        server.stop(30)
        raise RuntimeError(f"onlinespec serve {shlex.join(args)}: {error}\n{log_tail(log)}") from error
    try:
        yield Served(server.url, server.process, log)
    finally:
        server.stop()


def llama_server_binary() -> Path:
    """llama.cpp's C++ server: $ONLINESPEC_LLAMA_SERVER, else ~/.cache/onlinespec/bin/llama-server
    (what `make llama-server` builds)."""
    path = Path(os.environ.get(LLAMA_SERVER_ENV) or LLAMA_SERVER_DEFAULT).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"no llama-server binary at {path}: run `make llama-server` (builds llama.cpp's C++ server into "
                                f"{LLAMA_SERVER_DEFAULT}), or set {LLAMA_SERVER_ENV} to one")
    return path


def llama_server_command(model: str | Path, port: int, parallel: int = 1, ctx_size: int = 4096, threads: int = 2,
                         extra: Sequence[str] = ()) -> list[str]:
    """The command line: ``parallel`` slots of ``ctx_size`` tokens each (``-c`` is the total),
    continuous batching (llama-server's default, named anyway), no web UI."""
    return [str(llama_server_binary()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(parallel), "-c", str(ctx_size * parallel), "-t", str(threads), "-tb", str(threads),
            "--cont-batching", "--no-webui", *extra]


@contextlib.contextmanager
def serve_llama_server(model: str | Path, parallel: int = 1, ctx_size: int = 4096, threads: int = 2, extra: Sequence[str] = (),
                       port: int | None = None, log_path: str | Path | None = None, ready_timeout: float = 300) -> Iterator[Served]:
    """llama.cpp's ``llama-server`` on ``model`` (a GGUF file), as :func:`serve_onlinespec`: yields
    the base URL once GET /health answers 200; SIGINT on leaving, SIGKILL if it lingers."""
    llama_server_binary()  # its clear error before anything starts
    if not Path(model).is_file():
        raise FileNotFoundError(f"{model}: no such GGUF file (the default target's: onlinespec.models.default_gguf_path())")
    port = port or free_port()
    command = llama_server_command(model, port, parallel, ctx_size, threads, extra)
    with serve_command(command, f"http://127.0.0.1:{port}", "/health", _log_file(log_path, "llama-server"), ready_timeout) as url:
        yield url


@contextlib.contextmanager
def serve_command(command: Sequence[str], url: str, ready_path: str, log: Path, ready_timeout: float,
                  env: dict | None = None) -> Iterator[Served]:
    """Any HTTP server as a child process: ready when GET ``url + ready_path`` answers 200."""
    with open(log, "ab") as output:
        process = subprocess.Popen(list(command), stdout=output, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_ready(process, url + ready_path, ready_timeout, log)
        yield Served(url, process, log)
    finally:
        stop(process)


def wait_ready(process: subprocess.Popen, url: str, timeout: float, log: Path | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{shlex.join(process.args)} exited with code {process.returncode} before it was ready\n{log_tail(log)}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError(f"{url} was not ready within {timeout:.0f} s\n{log_tail(log)}")


def stop(process: subprocess.Popen, grace: float = 30) -> int:
    """SIGINT, then SIGTERM, each given ``grace`` seconds, then SIGKILL; the exit code."""
    for sent in (signal.SIGINT, signal.SIGTERM):
        if process.poll() is not None:
            return process.returncode
        process.send_signal(sent)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return process.wait(grace)
    process.kill()
    return process.wait()


# ------------------------------------------------------------------------------------------------
# Order and timing
# ------------------------------------------------------------------------------------------------


def interleave(items: Sequence, configs: Sequence) -> list[tuple]:
    """(item, config) pairs: every config on item i before item i + 1, the config that goes first
    rotating with i. This machine's speed drifts 2-3x within an hour; run back to back, one
    config's whole pass would meet a different machine than the next one's."""
    return [(item, config) for i, item in enumerate(items) for config in rotated(configs, i)]


def rotated(configs: Sequence, i: int) -> list:
    """The order of the configs on item ``i`` in :func:`interleave` (the i-th rotation)."""
    configs = list(configs)
    return configs[i % len(configs):] + configs[:i % len(configs)] if configs else []


@functools.lru_cache(maxsize=32)
def client(base_url: str, timeout: float = 900):
    """An `openai` client of a server's base URL (thread-safe; one per URL)."""
    import openai

    return openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=timeout)


@functools.lru_cache(maxsize=32)
def _served_model(api) -> str:
    return api.models.list().data[0].id


# the keyword arguments the `openai` client takes itself; any other goes into the request body
_OPENAI_FIELDS = {"temperature", "top_p", "seed", "stop", "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
                  "user", "extra_headers", "extra_query", "timeout"}


def stream_chat(base_url, messages: str | Sequence[dict], max_tokens: int, model: str | None = None, **extra) -> dict:
    """One streamed chat completion through the `openai` client, timed. ``base_url``: the
    server's base URL or an ``openai.OpenAI`` client; ``messages``: the chat (a string is one
    user message); ``model``: the first of /v1/models unless given; ``extra``: the client's own
    arguments (``temperature``, which defaults to 0 here: greedy, ``seed``, ``extra_headers`` ...),
    any other goes into the request body (``repeat_penalty``, ``domain`` ...).

    Returns ttft_s (request sent to first content), tpot_s (time after the first token over
    tokens - 1; None under two tokens), total_s, text, completion_tokens, tokens_from ("usage":
    the server's stream_options usage; "chunks": no usage came, so content chunks were counted,
    one token each, which a server that sends several tokens per chunk undercounts),
    prompt_tokens (None without usage), finish_reason and the perf_counter start and end; with
    ``logprobs=True, top_logprobs=n`` (chat), logprobs: per token ``[token, logprob, [[token,
    logprob], ...]]``."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return _timed(base_url, "chat", list(messages), max_tokens, model, extra)


def stream_completion(base_url, prompt: str, max_tokens: int, model: str | None = None, **extra) -> dict:
    """:func:`stream_chat` for /v1/completions (a raw prompt, no chat template)."""
    return _timed(base_url, "completion", prompt, max_tokens, model, extra)


def _timed(base_url, kind: str, content, max_tokens: int, model: str | None, extra: dict) -> dict:
    api = client(base_url) if isinstance(base_url, str) else base_url
    kwargs = {"temperature": 0.0, **{k: v for k, v in extra.items() if k in _OPENAI_FIELDS}}
    body = {k: v for k, v in extra.items() if k not in _OPENAI_FIELDS}
    kwargs.update(model=model or _served_model(api), max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                  extra_body=body or None)
    started = time.perf_counter()
    if kind == "chat":
        stream = api.chat.completions.create(messages=content, **kwargs)
    else:
        stream = api.completions.create(prompt=content, **kwargs)
    first, pieces, usage, finish, logprobs = None, [], None, None, []
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices:
            choice = chunk.choices[0]
            if choice.logprobs is not None:  # asked for (logprobs=True, top_logprobs=n): [token, logprob, [[token, logprob], ...]]
                entries = choice.logprobs.content if kind == "chat" else None
                logprobs += [[e.token, e.logprob, [[t.token, t.logprob] for t in e.top_logprobs or []]] for e in entries or []]
            piece = choice.delta.content if kind == "chat" else choice.text
            finish = choice.finish_reason or finish
            if piece:
                first = first or time.perf_counter()
                pieces.append(piece)
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else len(pieces)
    return {"ttft_s": (first or end) - started, "tpot_s": (end - first) / (tokens - 1) if first and tokens > 1 else None,
            "total_s": end - started, "text": "".join(pieces), "completion_tokens": tokens, "tokens_from": "usage" if usage else "chunks",
            "prompt_tokens": usage.prompt_tokens if usage else None, "finish_reason": finish, "start": started, "end": end,
            **({"logprobs": logprobs} if logprobs else {})}


# ------------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg: no display needed)
# ------------------------------------------------------------------------------------------------


def figure(nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] = (8, 4), **kwargs):
    """``plt.subplots`` on the Agg backend; finish with :func:`save`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=figsize, **kwargs)


def save(fig, path: str | Path, dpi: int = 120) -> Path:
    """Lay out, write the PNG (parent folders made) and close the figure."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def lines(ax, series: dict, title: str = "", xlabel: str = "", ylabel: str = "", hline: float | None = None, **style) -> None:
    """One line per entry of ``series``: name -> ys, or name -> (xs, ys)."""
    for name, values in series.items():
        xs, ys = values if isinstance(values, tuple) else (range(1, len(values) + 1), values)
        ax.plot(list(xs), list(ys), label=name, **style)
    if hline is not None:
        ax.axhline(hline, color="k", lw=0.8)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if len(series) > 1:
        ax.legend(fontsize=8)


def bars(ax, groups: Sequence[str], series: dict[str, Sequence[float]], title: str = "", ylabel: str = "",
         hline: float | None = None, annotate: str | None = None) -> None:
    """Grouped bars: for each group (x tick), one bar per entry of ``series`` (name -> one value
    per group); ``annotate``: a format for the value above each bar ("{:.2f}")."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + i * width - 0.4 + width / 2 for g in range(len(groups))]
        ax.bar(xs, list(values), width, label=name)
        for x, v in zip(xs, values) if annotate else []:
            ax.text(x, v, annotate.format(v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups))
    if hline is not None:
        ax.axhline(hline, color="k", lw=0.8)
    ax.set(title=title, ylabel=ylabel)
    if len(series) > 1:
        ax.legend(fontsize=7, ncol=2)


def plot_lines(path: str | Path, series: dict, title: str = "", xlabel: str = "", ylabel: str = "", hline: float | None = None,
               figsize: tuple[float, float] = (8, 4), **style) -> Path:
    """A one-panel line plot written to ``path`` (:func:`lines`)."""
    fig, ax = figure(figsize=figsize)
    lines(ax, series, title, xlabel, ylabel, hline, **style)
    return save(fig, path)


def plot_bars(path: str | Path, groups: Sequence[str], series: dict[str, Sequence[float]], title: str = "", ylabel: str = "",
              hline: float | None = None, annotate: str | None = None, figsize: tuple[float, float] = (8, 4)) -> Path:
    """A one-panel grouped bar chart written to ``path`` (:func:`bars`)."""
    fig, ax = figure(figsize=figsize)
    bars(ax, groups, series, title, ylabel, hline, annotate)
    return save(fig, path)
