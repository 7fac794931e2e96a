"""The target's weight format: which GGUF variant of the user's file llama.cpp serves.

On a CPU the weight format decides what a verified token costs, so it decides whether speculative
decoding can pay (arXiv 2310.07177, section 3's cost model: a round costs one verification of
``k + 1`` tokens plus ``k`` draft steps). ggml's CPU backend has batched (tinyBLAS) or repacked
matrix kernels for Q8_0, F16, Q4_0, IQ4_NL and the K-quants, and none for Q4_1, the packaged
default's format: there five verified tokens cost 3x one step, on Q8_0 about 2x, and a prompt
costs 1.7x what it costs on Q8_0 (docs/cpu-speculation.md has the measurements).

- ``as-is``: serve the user's file.
- a format name (:data:`FORMATS`): serve a copy converted by llama.cpp's own quantiser
  (``llama_model_quantize``), written under ``$ONLINESPEC_CACHE/formats/``, never beside the
  user's file. Its quality is measured, not assumed: perplexity on held-out text
  (:func:`quality_text`, the documentation of this machine's Python standard library) against the
  user's file, and the copy is refused past :data:`MAX_PERPLEXITY_RISE`.
- ``auto`` (what ``serve`` and ``bench`` default to): the format :func:`choose` recorded for the
  file on this machine, the user's file where none was. :func:`choose` prices a reference request
  (its prompt's forward, then its new tokens by the cost model at the acceptance the deployment
  measured, or the target alone) on costs measured here, and keeps the user's file unless another
  format wins by :data:`MIN_GAIN`. ``onlinespec convert --format auto`` runs it (``make setup``
  and ``onlinespec fetch-default`` do, for the packaged target); ``--expected-acceptance`` makes a
  server decide at its start.

Conversions, their perplexities and their curves are cached (a JSON beside each converted file),
so a later start decides in milliseconds.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from onlinespec.storage import atomic_write, cache_dir

log = logging.getLogger(__name__)

AS_IS, AUTO = "as-is", "auto"
# llama.cpp's llama_ftype ids (include/llama.h) of the formats worth serving on a CPU
FORMATS = {"f16": 1, "q8_0": 7, "q6_k": 18, "q5_k_m": 17, "q4_0": 2, "iq4_nl": 25}
AUTO_CANDIDATES = ("q8_0", "f16")  # the formats that keep a 4-bit file's quality (requantising to 4 bits costs 17-20% perplexity)
MAX_PERPLEXITY_RISE = 0.01  # a converted file may be at most 1% worse than the user's on the held-out text
DEFAULT_C = 0.1  # auto without a measured draft cost: draft time per drafted token over one step of the file as it is
MIN_GAIN = 0.03  # auto leaves the user's file unless another format is expected this much faster
QUALITY_TOKENS = 4096
# auto's reference request (where the deployment gives no shape of its own): a chat turn, its
# prompt (system prompt, history, question) twice its answer. The prompt matters: Q4_1 has no
# batched kernels, so a prompt costs it 1.7x what it costs Q8_0 (docs/cpu-speculation.md).
PROMPT_TOKENS, NEW_TOKENS = 256, 128
MAX_WIDTH, CONTEXT = 8, 128  # the measured cost curve: forwards of 1..MAX_WIDTH tokens after CONTEXT
QUALITY_WINDOW = 512  # tokens per perplexity window (each scored from its second token)
QUALITY_MODULES = ("json", "argparse", "collections", "logging", "pathlib", "subprocess", "textwrap", "heapq",
                   "difflib", "csv", "tarfile", "zipfile", "pickle", "string", "calendar", "fractions", "shutil",
                   "configparser", "email.message", "functools", "itertools", "re", "datetime", "decimal")


class FormatError(ValueError):
    """A format that cannot be served: unknown, not convertible here, or worse than allowed."""


@dataclass
class Variant:
    """A converted copy of a GGUF file and what was measured of it."""

    source: str
    format: str
    path: str
    size: int
    perplexity_source: float | None = None
    perplexity: float | None = None
    quality_tokens: int = 0

    @property
    def perplexity_rise(self) -> float | None:
        if self.perplexity is None or not self.perplexity_source:
            return None
        return self.perplexity / self.perplexity_source - 1


def check_format(name: str) -> str:
    name = name.lower().replace("-", "_") if name not in (AS_IS, AUTO) else name
    if name not in (AS_IS, AUTO, *FORMATS):
        raise FormatError(f"unknown target format {name!r}: use {AS_IS}, {AUTO} or one of {', '.join(FORMATS)}")
    return name


def variant_path(source: Path, fmt: str) -> Path:
    """Where the ``fmt`` copy of ``source`` lives: the cache, under the source's identity."""
    source = Path(source).resolve()
    stat = source.stat()
    key = hashlib.sha256(f"{source}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "formats" / f"{source.stem}-{key}" / f"{source.stem}.{fmt}.gguf"


def convert(source: Path, fmt: str, threads: int | None = None) -> Path:
    """``source`` converted to ``fmt`` by llama.cpp's quantiser (cached; atomic: a crash leaves no half file)."""
    from onlinespec.decoding.runners.llamacpp import _bindings, cpu_threads

    fmt = check_format(fmt)
    if fmt not in FORMATS:
        raise FormatError(f"{fmt} is not a format to convert to")
    out = variant_path(source, fmt)
    if out.exists():
        return out
    lib = _bindings()
    out.parent.mkdir(parents=True, exist_ok=True)
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = FORMATS[fmt], True, threads or cpu_threads()
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        started = time.perf_counter()
        status = lib.llama_model_quantize(str(source).encode(), tmp.encode(), params)
        if status != 0:
            raise FormatError(f"llama.cpp could not convert {source.name} to {fmt} (status {status})")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
        log.info("converted %s to %s in %.1f s: %s", source.name, fmt, time.perf_counter() - started, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def quality_text(min_chars: int = 40_000) -> str:
    """Held-out English documentation the target was not tuned on: the docstrings of this
    machine's Python standard library modules :data:`QUALITY_MODULES` (and their classes), in order."""
    import importlib

    parts: list[str] = []
    for name in QUALITY_MODULES:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module) or ""]
        docs += [inspect.getdoc(obj) or "" for _, obj in sorted(vars(module).items())
                 if inspect.isclass(obj) and obj.__module__ == module.__name__]
        parts.extend(d for d in docs if len(d) > 200)
        if sum(map(len, parts)) >= min_chars:
            break
    return "\n\n".join(parts)


def perplexity(path: Path, text: str, tokens: int = QUALITY_TOKENS, window: int = QUALITY_WINDOW) -> tuple[float, int]:
    """(perplexity, tokens scored) of the GGUF at ``path`` on the first ``tokens`` tokens of
    ``text``, in windows of ``window`` tokens, each token scored given the window before it."""
    import torch

    from onlinespec.decoding.runners.llamacpp import LlamaCppModel, LlamaCppRunner, _bindings

    lib = _bindings()
    model = LlamaCppModel.load(path)
    ids = tokenize(lib, model, text)[:tokens]
    if len(ids) < 2 * window:
        raise FormatError(f"the quality text has {len(ids)} tokens: at least {2 * window} are needed")
    runner = LlamaCppRunner(model, max_rows=1, context=window)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start: start + window]
        if len(chunk) < 2:
            break
        row = object()
        logits, _ = runner.forward_alone(row, chunk, len(chunk))
        runner.release([row])
        logprobs = torch.log_softmax(logits[:-1].float(), -1)
        total -= logprobs.gather(1, torch.tensor(chunk[1:]).unsqueeze(1)).sum().item()
        count += len(chunk) - 1
    return math.exp(total / count), count


def tokenize(lib, model, text: str) -> list[int]:
    """``text`` as llama.cpp tokenizes it with ``model``'s vocabulary (no special tokens parsed)."""
    vocab = lib.llama_model_get_vocab(model.pointer)
    raw = text.encode()
    buffer = (lib.llama_token * (len(raw) + 8))()
    n = lib.llama_tokenize(vocab, raw, len(raw), buffer, len(buffer), True, False)
    if n < 0:
        raise FormatError("llama.cpp could not tokenize the quality text")
    return list(buffer[:n])


def measured_variant(source: Path, fmt: str, tokens: int = QUALITY_TOKENS) -> Variant:
    """The ``fmt`` copy of ``source`` with its perplexity and the source's on ``tokens`` tokens
    of :func:`quality_text` (cached beside it)."""
    path = convert(source, fmt)
    record = path.with_suffix(".json")
    if record.exists():
        try:
            saved = Variant(**{k: v for k, v in json.loads(record.read_text()).items() if k in Variant.__dataclass_fields__})
            if saved.perplexity is not None and saved.quality_tokens >= tokens - 1 - tokens // QUALITY_WINDOW:
                return saved
        except (OSError, ValueError, TypeError) as err:
            log.warning("%s could not be read (%s): measuring again", record, err)
    text = quality_text()
    started = time.perf_counter()
    source_ppl, scored = _source_perplexity(str(source), _identity(Path(source)), text, tokens)
    ppl, _ = perplexity(path, text, tokens)
    found = Variant(str(source), fmt, str(path), path.stat().st_size, source_ppl, ppl, scored)
    log.info("%s: perplexity %.3f against %.3f as shipped (%+.2f%%, %d tokens, %.0f s)", path.name, ppl, source_ppl,
             100 * found.perplexity_rise, scored, time.perf_counter() - started)
    atomic_write(record, json.dumps(asdict(found), indent=1))
    return found


@functools.lru_cache(maxsize=4)
def _source_perplexity(path: str, identity: tuple, text: str, tokens: int) -> tuple[float, int]:
    """:func:`perplexity` of the user's file, measured once per process for every format compared
    with it (``auto`` measures two); ``identity`` (size and modification time) keys a changed file anew."""
    return perplexity(Path(path), text, tokens)


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def served_file(source: Path, fmt: str, acceptance: float | None = None, draft_ms: float | None = None,
                quality_tokens: int = QUALITY_TOKENS) -> Path:
    """The file llama.cpp serves for ``source`` under ``--target-format fmt`` (see the module
    docstring); a converted copy whose perplexity rises past :data:`MAX_PERPLEXITY_RISE` is refused."""
    fmt = check_format(fmt)
    if fmt == AS_IS:
        return Path(source)
    if fmt == AUTO:
        if acceptance is not None:  # the deployment's own acceptance: decide now (measuring what is not cached)
            return choose(Path(source), acceptance, draft_ms).path
        return chosen_file(Path(source))
    found = measured_variant(Path(source), fmt, quality_tokens)
    if found.perplexity_rise > MAX_PERPLEXITY_RISE:
        raise FormatError(f"{source} converted to {fmt} loses quality: perplexity {found.perplexity:.3f} against "
                          f"{found.perplexity_source:.3f} as shipped ({100 * found.perplexity_rise:+.1f}%, the limit is "
                          f"+{100 * MAX_PERPLEXITY_RISE:.0f}%): serve it as-is, or choose q8_0 or f16")
    return Path(found.path)


@dataclass
class Costs:
    """What a file's forwards cost on this machine, as the engine runs them."""

    curve: list[float]  # ms of one forward of 1..w new tokens after CONTEXT tokens (every row's logits)
    prompt_ms: float  # ms per prompt token, a PROMPT_TOKENS-token prompt in one forward

    def request_ms(self, acceptance: float | None, draft_ms: float, prompt_tokens: int, new_tokens: int) -> float:
        """Expected ms of a request: its prompt, then its new tokens with the best k at
        ``acceptance`` (None: the target alone)."""
        decode = self.curve[0] if acceptance is None else ms_per_token(self.curve, acceptance, draft_ms)
        return prompt_tokens * self.prompt_ms + new_tokens * decode


@dataclass
class Choice:
    """What ``auto`` chose, and why: expected ms of the reference request on each candidate."""

    path: Path
    format: str
    acceptance: float | None
    request_ms: dict[str, float]
    perplexity_rise: dict[str, float]
    costs: dict[str, Costs] = field(default_factory=dict)
    prompt_tokens: int = PROMPT_TOKENS
    new_tokens: int = NEW_TOKENS


def choose(source: Path, acceptance: float | None, draft_ms: float | None, candidates=AUTO_CANDIDATES,
           prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS, quality_tokens: int = QUALITY_TOKENS) -> Choice:
    """The format among ``candidates`` (and the user's file) that serves a request of
    ``prompt_tokens`` + ``new_tokens`` fastest on this machine's measured costs (the prompt's
    forward, then decoding by the cost model at ``acceptance`` with ``draft_ms`` per drafted token;
    no acceptance: the target alone), among those within the quality limit. The user's file
    unless another wins by :data:`MIN_GAIN`. The choice is recorded for :func:`chosen_file`."""
    paths, rises = {AS_IS: Path(source)}, {}
    for fmt in candidates:
        found = measured_variant(source, fmt, quality_tokens)
        rises[fmt] = found.perplexity_rise
        if found.perplexity_rise <= MAX_PERPLEXITY_RISE:
            paths[fmt] = Path(found.path)
    costs = measured_costs(paths)
    if draft_ms is None:  # a draft that costs DEFAULT_C of a step of the file as it is
        draft_ms = DEFAULT_C * costs[AS_IS].curve[0]
    request = {fmt: c.request_ms(acceptance, draft_ms, prompt_tokens, new_tokens) for fmt, c in costs.items()}
    best = min(request, key=request.get)
    if best != AS_IS and request[best] > (1 - MIN_GAIN) * request[AS_IS]:
        best = AS_IS
    log.info("--target-format auto (%d prompt + %d new tokens, acceptance %s): %s (ms per request %s)", prompt_tokens,
             new_tokens, acceptance, best, {k: round(v, 1) for k, v in request.items()})
    found = Choice(paths[best], best, acceptance, request, rises, costs, prompt_tokens, new_tokens)
    _record_choice(Path(source), found)
    return found


def chosen_file(source: Path) -> Path:
    """The file :func:`choose` last chose for ``source`` on this machine (``onlinespec convert
    --format auto``, which ``make setup`` and ``onlinespec fetch-default`` run for the packaged
    target); ``source`` itself when none was chosen, or the chosen copy is gone. Deciding takes a
    minute of quiet measurement, which a server's start does not do by surprise."""
    record = _choice_record(source)
    try:
        saved = json.loads(record.read_text())
        path = Path(saved["path"])
        if saved.get("source_identity") == list(_identity(source)) and path.exists():
            return path
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("%s could not be read (%s): serving %s as it is", record, err, source.name)
        return Path(source)
    log.info("--target-format auto: no format chosen for %s on this machine yet (`onlinespec convert --format auto`): "
             "serving it as it is", source.name)
    return Path(source)


def _choice_record(source: Path) -> Path:
    return variant_path(source, AUTO).parent / "auto-choice.json"


def _record_choice(source: Path, found: Choice) -> None:
    record = _choice_record(source)
    record.parent.mkdir(parents=True, exist_ok=True)
    saved = {"source": str(source), "source_identity": list(_identity(source)), "format": found.format, "path": str(found.path),
             "acceptance": found.acceptance, "prompt_tokens": found.prompt_tokens, "new_tokens": found.new_tokens,
             "request_ms": found.request_ms, "perplexity_rise": found.perplexity_rise,
             "costs": {fmt: asdict(c) for fmt, c in found.costs.items()}, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    atomic_write(record, json.dumps(saved, indent=1))


def ms_per_token(curve: list[float], acceptance: float, draft_ms: float) -> float:
    """Expected ms per token with the best k on ``curve`` (ms of a forward of 1..w tokens), k = 0
    being the target alone: (verify(k + 1) + k draft_ms) / E(acceptance, k)."""
    from onlinespec.costmodel import expected_tokens_per_round

    options = [curve[0]]
    for k in range(1, len(curve)):
        options.append((curve[k] + k * draft_ms) / expected_tokens_per_round(min(acceptance, 0.999), k))
    return min(options)


def measured_costs(paths: dict[str, Path], reps: int = 5) -> dict[str, Costs]:
    """:class:`Costs` of each file, measured interleaved (round by round across the files: this
    CPU's speed drifts within minutes) where not cached beside the file."""
    from onlinespec.decoding.runners.llamacpp import cpu_threads

    saved = {name: json.loads(_curve_record(p).read_text()) if _curve_record(p).exists() else {} for name, p in paths.items()}
    keys = {name: f"{p.name}|{p.stat().st_size}|w{MAX_WIDTH}|c{CONTEXT}|p{PROMPT_TOKENS}|t{cpu_threads()}" for name, p in paths.items()}
    missing = [name for name in paths if keys[name] not in saved[name]]
    if missing:
        for name, costs in _measure({name: paths[name] for name in missing}, reps).items():
            saved[name][keys[name]] = asdict(costs)
            record = _curve_record(paths[name])
            record.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(record, json.dumps(saved[name], indent=1))
    return {name: Costs(**saved[name][keys[name]]) for name in paths}


def _measure(paths: dict[str, Path], reps: int) -> dict[str, Costs]:
    import statistics

    import torch

    from onlinespec.decoding.calibrate import forward_costs
    from onlinespec.decoding.runners.llamacpp import LlamaCppModel, LlamaCppRunner

    runners = {name: LlamaCppRunner(LlamaCppModel.load(p), max_rows=1, context=max(CONTEXT + MAX_WIDTH, PROMPT_TOKENS) + 8)
               for name, p in paths.items()}
    curves, prompts = {name: [] for name in paths}, {name: [] for name in paths}
    prompt = torch.randint(0, min(r.vocab_size for r in runners.values()), (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    for _ in range(reps):
        for name, runner in runners.items():
            curves[name].append(forward_costs(runner, MAX_WIDTH, CONTEXT, reps=1))
            row = object()
            start = time.perf_counter()
            runner.forward_alone(row, prompt, 1)
            prompts[name].append(time.perf_counter() - start)
            runner.release([row])
    return {name: Costs([round(1000 * statistics.median(c[w] for c in curves[name]), 3) for w in range(MAX_WIDTH)],
                        round(1000 * statistics.median(prompts[name]) / PROMPT_TOKENS, 4)) for name in paths}


def _curve_record(path: Path) -> Path:
    digest = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:12]
    return cache_dir() / "formats" / "curves" / f"{Path(path).stem}-{digest}.json"


def remove_variants(source: Path) -> int:
    """Delete every converted copy of ``source`` (``onlinespec convert --clean``); how many files went."""
    folder = variant_path(source, "q8_0").parent
    count = len(list(folder.glob("*"))) if folder.exists() else 0
    shutil.rmtree(folder, ignore_errors=True)
    return count
