"""What a run keeps: the draft registries (list, roll back) and the query data (list, export, stream, purge)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from onlinespec.cli.common import console, data_app, drafts_app, out, user_errors

RegistryOpt = Annotated[Path, typer.Option("--dir", exists=True, file_okay=False, help="<online --out-dir>/drafts (every draft), or one draft's registry")]
DraftNameOpt = Annotated[Optional[str], typer.Option("--draft", help="which draft, when --dir holds several (one per domain)")]


def _registries(directory: Path, name: str | None = None) -> dict:
    """{draft name: registry}: ``directory`` itself when it is a registry, else every draft
    registry in it (an online run's drafts/ folder holds one per routed draft)."""
    from onlinespec.online.registry import DraftRegistry

    if (directory / "CURRENT").exists():
        return {directory.name: DraftRegistry(directory)}
    found = {p.name: DraftRegistry(p) for p in sorted(directory.iterdir()) if (p / "CURRENT").exists()}
    if not found:
        raise ValueError(f"{directory} holds no draft registry: pass <online --out-dir>/drafts or one draft's folder in it")
    if name is not None:
        if name not in found:
            raise ValueError(f"no draft {name!r} in {directory}; drafts: {', '.join(found)}")
        return {name: found[name]}
    return found


@drafts_app.command("list")
def drafts_list(directory: RegistryOpt = Path("runs/online/drafts"), draft: DraftNameOpt = None) -> None:
    """Every published version of every draft, with its parent, records seen, loss and alpha before/after."""
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    for name, registry in user_errors(lambda: _registries(directory, draft)).items():
        current = registry.current()
        table = Table(title=f"draft {name} ({registry.directory})")
        for col in ("version", "parent", "records seen", "loss before", "loss after", "alpha before", "alpha after", "note"):
            table.add_column(col, justify="right")
        for version in registry.versions():
            meta = registry.meta(version)
            label = f"* {version}" if version == current else version
            table.add_row(label, *(fmt(meta.get(k)) for k in ("parent", "records_seen", "loss_before", "loss_after", "alpha_before", "alpha_after", "note")))
        out.print(table)
        out.print(f"serving: {current or '-'} (* above)")
    routing_table(directory.parent)


def routing_table(out_dir: Path) -> None:
    """Content routing's lifecycle and clusters, as the server last saved them (``routing.json``)."""
    from onlinespec.routing.lifecycle import ROUTING_FILE

    path = out_dir / ROUTING_FILE
    if not path.exists():
        return
    state = json.loads(path.read_text())
    table = Table(title=f"content routing ({path}): {state['router']['requests']} requests routed")
    for col in ("draft", "state", "clusters (members)"):
        table.add_column(col)
    clusters = [c for c in state["router"]["clusters"] if c["live"]]
    names = [*state.get("in_memory", []), *state.get("evicted", []), *state.get("retired", {})]
    for name in dict.fromkeys(names):
        where = ("retired: " + state["retired"][name]) if name in state.get("retired", {}) else (
            "evicted (in its registry)" if name in state.get("evicted", []) else "in memory")
        served = ", ".join(f"{c['id']} ({c['members']})" for c in clusters if c["draft"] == name) or "-"
        table.add_row(name, where, served)
    out.print(table)
    out.print(f"lifecycle: {state.get('lifecycle', {})}; detections: {state.get('detections', {})}")


@drafts_app.command("rollback")
def drafts_rollback(
    directory: RegistryOpt = Path("runs/online/drafts"),
    draft: DraftNameOpt = None,
    to: Annotated[Optional[str], typer.Option(help="the version to serve (default: the current one's parent)")] = None,
) -> None:
    """Serve an earlier version: the current one's parent, or the one named with --to. A process
    serving from this folder takes it within a second (its update in flight publishes nothing);
    the next run on the same --out-dir starts from it."""
    registries = user_errors(lambda: _registries(directory, draft))
    if len(registries) > 1:
        console.print(f"[red]error:[/red] {directory} holds {len(registries)} drafts ({', '.join(registries)}): name one with --draft")
        raise typer.Exit(2)
    (name, registry), = registries.items()
    before = registry.current()
    version = user_errors(lambda: registry.set_current(to) or to if to else registry.rollback())
    console.print(f"draft {name}: serving {version} (was {before})")


@data_app.command("list")
def data_list() -> None:
    """List the packaged data sources."""
    from onlinespec.data import SOURCES

    table = Table("source", "description")
    for name, source in SOURCES.items():
        table.add_row(name, source.description)
    out.print(table)


@data_app.command("export")
def data_export(
    out: Annotated[Path, typer.Option(help="JSONL file to write")],
    n: Annotated[int, typer.Option(min=1, help="number of prompts, spread evenly over the domains")] = 60,
    domains: Annotated[str, typer.Option(help="comma-separated")] = "chat,code,math",
    seed: int = 0,
    max_new_tokens: Annotated[Optional[int], typer.Option(min=1)] = None,
    split_name: Annotated[Optional[str], typer.Option("--split", help="warmup, online or heldout queries only (default: any)")] = None,
) -> None:
    """Export packaged real prompts as a JSONL prompt file (for bench and generate)."""
    import dataclasses

    from onlinespec.data import packaged_prompts, write_queries_jsonl

    queries = user_errors(lambda: packaged_prompts(n, tuple(domains.split(",")), seed=seed, split=split_name))
    if max_new_tokens:
        queries = [dataclasses.replace(q, max_new_tokens=max_new_tokens) for q in queries]
    write_queries_jsonl(out, queries)
    console.print(f"wrote {len(queries)} prompts to {out}")


@data_app.command("stream")
def data_stream(
    out: Annotated[Path, typer.Option(help="JSONL file to write")],
    domains: Annotated[str, typer.Option(help="comma-separated, in stream order: chat, code, math, math_ml (maths in 23 languages), stdlib (standard-library functions to complete)")] = "math,code,chat",
    schedule: Annotated[str, typer.Option(help="abrupt (shift every N), gradual (mix across each block) or random")] = "abrupt",
    every: Annotated[int, typer.Option(min=1, help="queries per domain block")] = 100,
    split_name: Annotated[str, typer.Option("--split", help="warmup, online or heldout queries only")] = "online",
    seed: int = 0,
) -> None:
    """Export a query stream of packaged real data with a domain-shift schedule."""
    from onlinespec.data import write_queries_jsonl
    from onlinespec.data.sources import stream_pools
    from onlinespec.data.splits import split
    from onlinespec.data.streams import abrupt_shifts, gradual_mix, random_mix

    def build():
        pools = {d: split(pool, split_name) for d, pool in stream_pools(domains.split(",")).items()}
        if schedule == "abrupt":
            return abrupt_shifts(pools, every, seed)
        if schedule == "gradual":
            return gradual_mix(pools, every, seed)
        if schedule == "random":
            return random_mix(pools, every * len(pools), seed=seed)
        raise ValueError(f"unknown schedule {schedule!r}: use abrupt, gradual or random")

    queries = user_errors(build)
    write_queries_jsonl(out, queries)
    console.print(f"wrote {len(queries)} queries to {out}")


@data_app.command("purge")
def data_purge(
    out_dir: Annotated[Path, typer.Option(exists=True, file_okay=False, help="the --out-dir of `onlinespec serve` or `online`")],
    request_id: Annotated[Optional[str], typer.Option(help="delete this request's training records (the id clients sent as X-Request-Id)")] = None,
    older_than_days: Annotated[Optional[float], typer.Option(min=0.0, help="delete the records older than this many days")] = None,
) -> None:
    """Delete a request's traces (or those older than a number of days) from everything the out-dir keeps: every
    draft's replay buffer and suffix index, the content router's state and every event log. A server running on
    --out-dir holds it: ask it instead (POST /admin/data/purge, same fields)."""
    from onlinespec.online.pool import purge_saved
    from onlinespec.storage import OutDirBusy, OutDirLock

    if (request_id is None) == (older_than_days is None):
        console.print("[red]error:[/red] give exactly one of --request-id and --older-than-days")
        raise typer.Exit(2)
    try:
        lock = OutDirLock(out_dir).acquire()
    except OutDirBusy as err:
        console.print(f"[red]error:[/red] {err}. While it serves, ask it: POST /admin/data/purge with "
                      '{"request_id": ...} or {"older_than_days": ...} (admin key)')
        raise typer.Exit(2) from None
    try:
        before = None if older_than_days is None else time.time() - older_than_days * 86400.0
        gone = purge_saved(out_dir, request_id, before)
        removed = gone["records"]
        with open(out_dir / "events.jsonl", "a") as log:
            log.write(json.dumps({"event": "purge", "request_id": request_id, "older_than_days": older_than_days,
                                  "records": sum(removed.values()), "suffix_requests": gone["suffix_requests"],
                                  "by": "onlinespec data purge", "time": time.time()}) + "\n")
    finally:
        lock.release()
    out.print(f"deleted {sum(removed.values())} records ({', '.join(f'{k}: {v}' for k, v in removed.items()) or 'no buffers'}), "
              f"{gone['suffix_requests']} requests from the suffix indices, {gone['routing_prompts']} prompts from the "
              f"content router's state and {gone['event_lines']} event-log lines")


# ------------------------------------------------------------------------------------------------
