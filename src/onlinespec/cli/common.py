"""What every command shares: the typer apps, the consoles, the option types and the error handling."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, help="onlinespec: lossless speculative decoding whose draft learns from live traffic (arXiv 2310.07177).")
data_app = typer.Typer(no_args_is_help=True, help="Real query data: list sources, export prompt files.")
app.add_typer(data_app, name="data")
drafts_app = typer.Typer(no_args_is_help=True, help="The versioned draft registry of an online run: list, roll back, serve a version.")
app.add_typer(drafts_app, name="drafts")
console = Console(stderr=True)  # progress and messages
out = Console(width=None if sys.stdout.isatty() else 160)  # results

DraftOpt = Annotated[str, typer.Option(help="'hybrid[:HEAD]' (HEAD 'fresh': a head born from the target, learning from traffic, the default for a target without a packaged head; a head folder; or a server's OUT_DIR/drafts/NAME: the version it serves), 'head[:HEAD]', 'ngram[:N]', 'target-layers:N', a head folder, a HF folder, a .gguf file (a draft model llama.cpp runs beside a .gguf target), or 'none'")]
TargetOpt = Annotated[str, typer.Option(help="'default' (packaged SmolLM2-135M-Instruct), a HF folder or a .gguf file")]
KOpt = Annotated[int, typer.Option("--k", "-k", min=0, help="proposal length k (tokens drafted per round)")]
DtypeOpt = Annotated[str, typer.Option(help="torch backend: float32, bfloat16 or auto (bfloat16 on CUDA, else float32)")]
TargetFormatOpt = Annotated[str, typer.Option(help="llama.cpp: the weight format served: auto (the format `onlinespec convert --format auto` chose for "
                                                   "the file on this machine, which make setup and fetch-default run for the default target; the file as "
                                                   "it is if none was chosen), as-is (the file given), or a format llama.cpp converts it to in the cache "
                                                   "(q8_0, f16, q6_k, ...; refused past +1% perplexity) (docs/cpu-speculation.md)")]
NglOpt = Annotated[int, typer.Option("--n-gpu-layers", "-ngl", help="llama.cpp: layers a GPU build of llama-cpp-python offloads (-1: all; a CPU build ignores it)")]
BackendOpt = Annotated[str, typer.Option(help="what runs the target: auto (llama.cpp for a .gguf file or 'default' on a CPU, else torch), llama.cpp or torch")]
DeviceOpt = Annotated[str, typer.Option(help="torch backend: auto (cuda when torch sees one), cpu or cuda")]


def sampling_params(max_new_tokens, temperature, top_p, top_k, seed, stop):
    from onlinespec.decoding.sampling import SamplingParams

    return user_errors(lambda: SamplingParams(max_new_tokens, temperature, top_p, top_k, stop, seed))


def user_errors(fn):
    """Run ``fn``; turn a bad-input error into a clear message and exit code 2."""
    from onlinespec.serve.handles import LoadFailed
    from onlinespec.storage import OutDirBusy

    try:
        return fn()
    except (ValueError, FileNotFoundError, OutDirBusy, LoadFailed) as err:
        console.print(f"[red]error:[/red] {err}")
        raise typer.Exit(2) from None
