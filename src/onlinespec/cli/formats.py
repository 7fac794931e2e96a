"""``onlinespec convert``: write a GGUF target's variant in another weight format to the cache,
with its measured quality and cost curve (:mod:`onlinespec.formats`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from onlinespec import formats
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
    target_format: Annotated[str, typer.Option("--format", "--target-format", help="q8_0, f16, q6_k, ... or auto (compare q8_0 and f16 with the file as it is, and record the choice that serve's --target-format auto then serves)")] = "auto",
    acceptance: Annotated[float | None, typer.Option(min=0.0, max=1.0, help="auto: the acceptance your traffic reaches (the server's vllm:spec_decode acceptance, or bench's); none: priced as the target alone")] = None,
    draft_ms: Annotated[float, typer.Option(min=0.0, help="auto: milliseconds per drafted token (bench's draft cost c x one step)")] = 0.5,
    prompt_tokens: Annotated[int, typer.Option(min=0, help="auto: your requests' typical prompt length (vllm:prompt_tokens_total over requests)")] = formats.PROMPT_TOKENS,
    new_tokens: Annotated[int, typer.Option(min=1, help="auto: your requests' typical answer length (vllm:generation_tokens_total over requests)")] = formats.NEW_TOKENS,
    clean: Annotated[bool, typer.Option("--clean", help="delete every converted copy of the target (and auto's choice) instead")] = False,
) -> None:
    """Convert a GGUF target with llama.cpp's quantiser into the cache (never beside the file),
    measure its perplexity against the file as it is (refused past +1%) and what its forwards
    cost here (a prompt, 1..8 new tokens), and print the expected milliseconds of a request on
    each. With --format auto the fastest is recorded: `serve --target-format auto` (the default)
    serves it from then on."""
    source = user_errors(lambda: _source(target))
    if clean:
        console.print(f"removed {formats.remove_variants(source)} converted file(s) of {source.name}")
        return
    fmt = user_errors(lambda: formats.check_format(target_format))
    with console.status("converting, measuring perplexity and costs (a minute or two on the default, once)"):
        if fmt == formats.AUTO:
            choice = user_errors(lambda: formats.choose(source, acceptance, draft_ms, prompt_tokens=prompt_tokens, new_tokens=new_tokens))
            rows = {name: formats.measured_variant(source, name) for name in formats.AUTO_CANDIDATES}
            costs = choice.costs
        else:
            rows = {fmt: user_errors(lambda: formats.measured_variant(source, fmt))}
            choice = None
            costs = formats.measured_costs({formats.AS_IS: source, fmt: Path(rows[fmt].path)})
    table = Table("format", "file", "MB", "perplexity", "vs as-is", "ms per prompt token", "ms for 1 / 2 / 4 / 8 tokens",
                  f"ms per request ({prompt_tokens} + {new_tokens})")
    request = choice.request_ms if choice else {name: c.request_ms(acceptance, draft_ms, prompt_tokens, new_tokens) for name, c in costs.items()}
    table.add_row("as-is", source.name, f"{source.stat().st_size / 1e6:.0f}", _ppl(next(iter(rows.values())).perplexity_source), "",
                  *_costs(costs.get(formats.AS_IS)), _ms(request.get(formats.AS_IS)))
    for name, found in rows.items():
        table.add_row(name, Path(found.path).name, f"{found.size / 1e6:.0f}", _ppl(found.perplexity), f"{100 * found.perplexity_rise:+.2f}%",
                      *_costs(costs.get(name)), _ms(request.get(name)))
    console.print(table)
    at = "the target alone" if acceptance is None else f"acceptance {acceptance:.2f}"
    if choice is not None:
        console.print(f"auto ({at}, {prompt_tokens} prompt + {new_tokens} new tokens): [bold]{choice.format}[/bold] -> {choice.path}")
        console.print(f"recorded: onlinespec serve --target {target} (--target-format auto, the default) serves it")
    else:
        found = next(iter(rows.values()))
        ok = found.perplexity_rise <= formats.MAX_PERPLEXITY_RISE
        console.print(("serve it: onlinespec serve --target-format " + fmt) if ok else
                      f"[red]refused:[/red] {100 * found.perplexity_rise:+.1f}% perplexity is past the +1% limit")


def _ppl(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def _costs(costs) -> tuple[str, str]:
    """(ms per prompt token, the curve at 1/2/4/8 tokens) of a format, or blanks where it was not measured (refused)."""
    if costs is None:
        return "", ""
    return f"{costs.prompt_ms:.2f}", " / ".join(f"{costs.curve[w - 1]:.1f}" for w in (1, 2, 4, 8) if w <= len(costs.curve))
