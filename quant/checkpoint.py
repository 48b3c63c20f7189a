"""A safetensors checkpoint read a tensor, or a range of rows, at a time.

Quantizing must not hold the checkpoint in memory: a 27B checkpoint is 54 GB of bf16. Two ways
in, both through the files' own layout (the safetensors header: dtype, shape and byte range of
every tensor):

- `lazy()`: fresh, unevaluated MLX arrays of the files (`mx.load` reads a tensor only when it
  is evaluated). Arrays that are evaluated keep their bytes while referenced, so a caller takes
  fresh ones for the part it works on and drops them after (quant/stream.py: one layer at a time).
- `rows(name)`: a tensor's rows through a read-only memory map, copied into an MLX array only
  for the rows asked for: the 248k-row embedding table and head are read in chunks or by token,
  never whole. Mapped pages are file-backed: the kernel drops them under pressure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

# safetensors dtype -> (numpy dtype of the same width, MLX dtype)
_DTYPES = {
    "BF16": (np.uint16, mx.bfloat16),
    "F16": (np.float16, mx.float16),
    "F32": (np.float32, mx.float32),
    "I32": (np.int32, mx.int32),
    "U32": (np.uint32, mx.uint32),
    "I64": (np.int64, mx.int64),
    "U8": (np.uint8, mx.uint8),
    "I8": (np.int8, mx.int8),
    "BOOL": (np.bool_, mx.bool_),
}


@dataclass(frozen=True)
class Entry:
    file: Path
    dtype: str  # safetensors name: BF16, F32, ...
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and where its data begins."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return json.loads(fh.read(n)), 8 + n


class Checkpoint:
    """Every tensor of a folder's *.safetensors files, by name, without reading their data."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.entries: dict[str, Entry] = {}
        self.files = sorted(self.folder.glob("*.safetensors"))
        for f in self.files:
            header, data = read_header(f)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                b, e = info["data_offsets"]
                self.entries[name] = Entry(f, info["dtype"], tuple(info["shape"]), data + b, e - b)
        self._maps: dict[Path, np.memmap] = {}

    def nbytes(self, names=None) -> int:
        return sum(self.entries[n].nbytes for n in (names if names is not None else self.entries))

    def lazy(self, keep=lambda name: True) -> dict[str, mx.array]:
        """Fresh unevaluated arrays of the tensors whose names `keep` accepts."""
        out: dict[str, mx.array] = {}
        for f in self.files:
            if any(keep(n) for n, e in self.entries.items() if e.file == f):
                out.update({k: v for k, v in mx.load(str(f)).items() if keep(k)})
        return out

    def rows(self, name: str) -> "Rows":
        return Rows(self, name)

    def view(self, name: str) -> np.ndarray:
        e = self.entries[name]
        if e.dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {e.dtype} cannot be read by rows")
        mm = self._maps.get(e.file)
        if mm is None:
            mm = self._maps[e.file] = np.memmap(e.file, dtype=np.uint8, mode="r")
        return mm[e.start:e.start + e.nbytes].view(_DTYPES[e.dtype][0]).reshape(e.shape)


class Rows:
    """A tensor indexed along its first axis (a slice, or an array of row numbers); each read
    copies only those rows into a new MLX array in the stored dtype."""

    def __init__(self, checkpoint: Checkpoint, name: str):
        e = checkpoint.entries[name]
        self.checkpoint, self.name = checkpoint, name
        self.shape, self.ndim = e.shape, len(e.shape)
        self.dtype = _DTYPES[e.dtype][1]
        self.nbytes = e.nbytes

    def __getitem__(self, key) -> mx.array:
        view = self.checkpoint.view(self.name)
        if isinstance(key, mx.array):
            key = np.array(key)  # row numbers (token ids)
        picked = np.ascontiguousarray(view[key])
        out = mx.array(picked)
        return out.view(self.dtype) if out.dtype != self.dtype else out
