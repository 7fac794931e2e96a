"""A GGUF target's torch side, without its decoder: what the drafts need when llama.cpp runs it.

On the llama.cpp backend the target's forwards are llama.cpp's (docs/backends.md). The rest of
the system still needs, from the model: its config (hidden size, vocabulary, layers), its
generation config (EOS ids), its tokenizer, and the rows of its embedding and output tables that
a feature head reads (a head is born from the target: :meth:`FeatureHead.for_target`). Loading
the whole model in PyTorch for that cost 540 MB for the 135M default and about 6 GB (fp32) for a
1.5B; :func:`load_gguf_view` loads only those:

- config, generation config and tokenizer from the GGUF metadata (transformers' GGUF readers),
  saved once as a small folder in the cache (the packaged default's converted folder serves as
  its own), so a later start reads no token list from the GGUF again;
- the embedding (``token_embd.weight``) and output (``output.weight``; the embedding when tied)
  tables as :class:`QuantizedRows`: a read-only memory map of the quantized bytes in the GGUF
  file (the same pages llama.cpp maps), dequantized row by row when read (``gguf``'s numpy
  kernels, the ones transformers' GGUF loader uses: the same float32 values as a torch load).
"""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from onlinespec.storage import atomic_write, cache_dir, staged_dir

TABLES = {"embedding": "token_embd.weight", "output": "output.weight"}
TABLES_FILE = "gguf_tables.json"  # in the metadata folder: where the tables lie in the GGUF file


class QuantizedRows:
    """The rows of a ``[rows, cols]`` GGUF tensor, dequantized to float32 when indexed.

    ``rows[ids]`` is a float32 tensor of shape ``ids.shape + (cols,)``; nothing else of the table
    is ever materialised (the memory map's pages are shared with llama.cpp's map of the file)."""

    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, path: str | Path, offset: int, qtype: int, rows: int, cols: int) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path, self.qtype = Path(path), GGMLQuantizationType(qtype)
        block, size = GGML_QUANT_SIZES[self.qtype]
        self.shape = torch.Size((rows, cols))
        self._data = np.memmap(self.path, np.uint8, "r", offset, shape=(rows, cols // block * size))
        self._cache: torch.Tensor | None = None
        self._filled: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, ids) -> torch.Tensor:
        """Rows ``ids`` (a tensor, array or list of ids) as float32, ``ids.shape + (cols,)``.

        Each row is dequantized once, on its first read, into a float32 cache of the table's
        shape whose memory is taken lazily (an untouched page is never resident): a head pays
        memory only for the tokens it has read, and a repeated read is an index. The engine reads
        rows in inference mode and the learner outside it: the cache is an ordinary tensor, so
        that either may fill it (one made in inference mode refuses the other's writes)."""
        index = ids.detach().cpu() if isinstance(ids, torch.Tensor) else torch.as_tensor(np.asarray(ids))
        with torch.inference_mode(False):
            flat = index.reshape(-1).long()
            if self._cache is None:
                self._cache = torch.empty(self.shape, dtype=torch.float32)  # large: malloc maps it, pages come on first touch
                self._filled = torch.zeros(self.shape[0], dtype=torch.bool)
            missing = torch.unique(flat[~self._filled[flat]])
            if len(missing):
                from gguf.quants import dequantize

                rows = dequantize(np.asarray(self._data[missing.numpy()]), self.qtype)
                self._cache[missing] = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
                self._filled[missing] = True
            return self._cache[flat].reshape(*index.shape, self.shape[1])

class GGUFTarget(nn.Module):
    """The target's config, generation config and tables, with no decoder (llama.cpp runs it)."""

    def __init__(self, config, generation_config, embedding: QuantizedRows, output: QuantizedRows) -> None:
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.embedding, self.output = embedding, output
        # what asks a model for its dtype and device (a calibration key, LoadedModel.device) finds the CPU, float32
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def head_tables(self) -> tuple[QuantizedRows, QuantizedRows]:
        """(embedding, output) rows for a feature head (:meth:`FeatureHead.for_target`)."""
        return self.embedding, self.output

    def forward(self, *args, **kwargs):
        raise RuntimeError("this target's forwards run on llama.cpp (the GGUF view holds no decoder layers): "
                           "load it with --backend torch to run it in PyTorch")


def meta_dir(gguf: Path) -> Path:
    """The folder of ``gguf``'s config, generation config and tokenizer (made once)."""
    out = cache_dir() / "models" / "gguf-meta" / f"{gguf.stem}-{gguf.stat().st_size}"
    if not (out / "config.json").exists():
        _write_meta(gguf, out)
    return out


def _write_meta(gguf: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    folder, name = str(gguf.parent), gguf.name
    with read_once():
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config.__dict__.pop("quantization_config", None)
    with staged_dir(out) as tmp:
        tokenizer.save_pretrained(tmp)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        (tmp / "onlinespec_source.json").write_text(json.dumps({"gguf": str(gguf)}))


_READ_ONCE = threading.Lock()


@contextmanager
def read_once():
    """Within this block, transformers reads each GGUF file's metadata once.

    Loading a GGUF's config, tokenizer and weights with transformers parses the whole metadata
    (the vocabulary and merges: about 100k strings, read one numpy view at a time) once per
    object, and maps tensor names by building gguf's name table once per module: for the 135M
    default about 45 s of a 65 s conversion on one core of this project's 2-core machine. Here
    the parsed metadata (``load_gguf_checkpoint`` without tensors, handed out as copies: callers
    edit it), gguf's reader and the name tables are kept for the block's length. One block at
    a time (the patched names are module-wide)."""
    import copy
    import functools

    import gguf as gguf_lib
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    with _READ_ONCE:
        reader, load, names = gguf_lib.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf_lib.get_tensor_name_map
        readers, metadata = {}, {}

        def one_reader(path, *args, **kwargs):
            key = (str(path), args, tuple(sorted(kwargs.items())))
            if key not in readers:
                readers[key] = reader(path, *args, **kwargs)
            return readers[key]

        def one_load(path, return_tensors=False, **kwargs):
            if return_tensors or kwargs:
                return load(path, return_tensors=return_tensors, **kwargs)
            if str(path) not in metadata:
                metadata[str(path)] = load(path, return_tensors=False)
            return copy.deepcopy(metadata[str(path)])

        gguf_lib.GGUFReader, hf_gguf.load_gguf_checkpoint = one_reader, one_load
        gguf_lib.get_tensor_name_map = functools.lru_cache(maxsize=None)(names)
        try:
            yield
        finally:
            gguf_lib.GGUFReader, hf_gguf.load_gguf_checkpoint, gguf_lib.get_tensor_name_map = reader, load, names


def tables(gguf: Path, folder: Path) -> dict[str, QuantizedRows]:
    """The embedding and output tables of ``gguf`` (their places read once, then kept in ``folder``)."""
    record = folder / TABLES_FILE
    size = gguf.stat().st_size
    places = json.loads(record.read_text()) if record.exists() else {}
    if places.get("size") != size or places.get("file") != gguf.name:
        from gguf import GGUFReader

        found = {t.name: t for t in GGUFReader(gguf).tensors}
        if TABLES["embedding"] not in found:
            raise ValueError(f"{gguf} has no {TABLES['embedding']} tensor: not a decoder LM llama.cpp serves?")
        places = {"file": gguf.name, "size": size}
        for role, name in TABLES.items():
            if name in found:  # GGUF shapes are (cols, rows)
                t = found[name]
                places[role] = {"offset": int(t.data_offset), "qtype": int(t.tensor_type), "rows": int(t.shape[1]), "cols": int(t.shape[0])}
        try:
            atomic_write(record, json.dumps(places))
        except OSError:  # a read-only cache: read the places again next time
            pass
    embedding = QuantizedRows(gguf, **places["embedding"])
    output = QuantizedRows(gguf, **places["output"]) if "output" in places else embedding  # tied
    return {"embedding": embedding, "output": output}


def load_gguf_view(gguf: str | Path, folder: Path | None = None):
    """(a :class:`GGUFTarget` of ``gguf``, its transformers tokenizer); ``folder``: where its
    config and tokenizer already are (the packaged default's converted folder), else made once
    from the GGUF's metadata (:func:`meta_dir`)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf = Path(gguf)
    folder = folder or meta_dir(gguf)
    config = AutoConfig.from_pretrained(folder)
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    found = tables(gguf, folder)
    return GGUFTarget(config, generation, found["embedding"], found["output"]), AutoTokenizer.from_pretrained(folder)
