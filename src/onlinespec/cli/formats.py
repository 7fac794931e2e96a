"""``onlinespec convert``: write a GGUF target's variant in another weight format to the cache,
with its measured quality and cost curve (:mod:`onlinespec.formats`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from onlinespec.cli.common import TargetOpt, app, console, user_errors


def _source(target: str) -> Path:
    from onlinespec.models import DEFAULT_TARGET, default_gguf_path

    path = default_gguf_path() if target == DEFAULT_TARGET else Path(target).expanduser()
    if path.suffix != ".gguf" or not path.exists():
        raise ValueError(f"--target {target!r}: give 'default' or an existing .gguf file (formats are llama.cpp's)")
    return path


@app.command()
def convert(
    target: TargetOpt = "default",
    target_format: Annotated[str, typer.Option("--format", "--target-format", help="q8_0, f16, q6_k, ... or auto (compare q8_0 and f16 with the file as it is)")] = "auto",
    acceptance: Annotated[float | None, typer.Option(min=0.0, max=1.0, help="auto: the acceptance your traffic reaches (the server's vllm:spec_decode acceptance, or bench's)")] = None,
    draft_ms: Annotated[float, typer.Option(min=0.0, help="auto: milliseconds per drafted token (bench's draft cost c x one step)")] = 0.5,
    clean: Annotated[bool, typer.Option("--clean", help="delete every converted copy of the target instead")] = False,
) -> None:
    """Convert a GGUF target with llama.cpp's quantiser into the cache (never beside the file),
    measure its perplexity against the file as it is (refused past +1%) and its cost curve, and
    print the expected milliseconds per token of each at an acceptance; `serve --target-format`
    then serves it."""
    from onlinespec import formats

    source = user_errors(lambda: _source(target))
    if clean:
        console.print(f"removed {formats.remove_variants(source)} converted file(s) of {source.name}")
        return
    fmt = user_errors(lambda: formats.check_format(target_format))
    with console.status("converting, measuring perplexity and cost curves (a minute or two, once)"):
        if fmt == formats.AUTO:
            if acceptance is None:
                raise typer.BadParameter("auto needs the acceptance your traffic reaches: --acceptance 0.7", param_hint="--acceptance")
            choice = user_errors(lambda: formats.choose(source, acceptance, draft_ms))
            rows = {name: formats.measured_variant(source, name) for name in formats.AUTO_CANDIDATES}
        else:
            rows = {fmt: user_errors(lambda: formats.measured_variant(source, fmt))}
            choice = None
    table = Table("format", "file", "MB", "perplexity", "vs as-is", "ms for 1 / 2 / 4 / 8 tokens", "ms per token")
    base = formats.cost_curve_ms(source)
    table.add_row("as-is", source.name, f"{source.stat().st_size / 1e6:.0f}", _ppl(next(iter(rows.values())).perplexity_source), "",
                  _curve(base), _per_token(choice, formats.AS_IS))
    for name, found in rows.items():
        table.add_row(name, Path(found.path).name, f"{found.size / 1e6:.0f}", _ppl(found.perplexity), f"{100 * found.perplexity_rise:+.2f}%",
                      _curve(formats.cost_curve_ms(Path(found.path))), _per_token(choice, name))
    console.print(table)
    if choice is not None:
        console.print(f"auto at acceptance {acceptance:.2f}: [bold]{choice.format}[/bold] -> {choice.path}")
        console.print(f"serve it: onlinespec serve --target {target} --target-format auto --expected-acceptance {acceptance} (or --target-format {choice.format})")
    else:
        found = next(iter(rows.values()))
        ok = found.perplexity_rise <= formats.MAX_PERPLEXITY_RISE
        console.print(("serve it: onlinespec serve --target-format " + fmt) if ok else
                      f"[red]refused:[/red] {100 * found.perplexity_rise:+.1f}% perplexity is past the +1% limit")


def _ppl(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _curve(ms: list[float]) -> str:
    return " / ".join(f"{ms[w - 1]:.1f}" for w in (1, 2, 4, 8) if w <= len(ms))


def _per_token(choice, name: str) -> str:
    return f"{choice.ms_per_token[name]:.2f}" if choice is not None and name in choice.ms_per_token else ""
