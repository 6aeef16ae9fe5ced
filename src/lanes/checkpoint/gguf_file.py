"""A GGUF file opened once: its metadata as plain Python values and its tensors by GGUF name.

The header is parsed here rather than by `gguf.GGUFReader`, which keeps a numpy array for every part of
every field: for a 49,152-token vocabulary that is 160 MB while it lives and some 30 MB of the heap it
fragments after (docs/DECISIONS.md, "Resident memory"). Values are read as the reader gives them
(`ReaderField.contents`); tensors are views of one read-only mapping, shaped as the reader shapes them.
The gguf package still dequantizes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .errors import CheckpointError

Q = gguf.GGMLQuantizationType
# GGUF value types (the spec's numbering): struct formats of the scalars
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
ELEMENTS = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
            Q.I32: np.int32, Q.I64: np.int64}  # types read as values; every other type as bytes
ALIGNMENT = 32  # the data section's alignment when general.alignment is absent
VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges")


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor's record: `shape` in GGUF order (fastest dimension first), `data` a view of the mapping
    (values for float and integer types, [rows..., bytes a row] for block formats)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def n_bytes(self) -> int:
        return self.data.nbytes


class _Header:
    """A cursor over the mapping; every read past the end is a ValueError."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.at = buffer, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buffer):
            raise ValueError("the header runs past the end of the file")
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += size
        return value

    def string(self) -> str:
        size = self.take("Q")
        end = self.at + size
        if end > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        text = str(self.buffer[self.at:end], "utf-8")
        self.at = end
        return text

    def value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            inner, count = self.take("I"), self.take("Q")
            if inner in SCALARS:
                fmt = SCALARS[inner]
                size = struct.calcsize(fmt) * count
                if self.at + size > len(self.buffer):
                    raise ValueError("an array runs past the end of the file")
                values = np.frombuffer(self.buffer, np.dtype("<" + fmt), count, self.at).tolist()
                self.at += size
                return values
            return [self.value(inner) for _ in range(count)]
        raise ValueError(f"unknown value type {kind}")


class GGUFFile:
    """A memory-mapped GGUF file. Raises CheckpointError when it is truncated or not a GGUF file."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(self.path, "no such file")
        try:
            with self.path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.metadata, self.tensors = _parse(self._map)
        except (ValueError, OSError, UnicodeDecodeError, struct.error) as error:
            raise CheckpointError(self.path, f"truncated or corrupt GGUF file ({error})") from None

    def release(self) -> None:
        """Drop the tensors' views once every tensor is read, so the mapping's pages leave the process's
        resident memory (the mapping closes with the last view of it), and the vocabulary's arrays, which
        only the tokenizer reads (some 9 MB of Python objects for 49,152 tokens): build it first."""
        self.tensors = {}
        self._map = None
        self.metadata = {key: value for key, value in self.metadata.items() if key not in VOCABULARY}

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(self.path, "metadata has no general.architecture")
        return arch

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in torch order (GGUF lists dimensions fastest first)."""
        return tuple(reversed(self.tensors[name].shape))

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 (or its float type), in torch order, dequantized with the gguf package."""
        tensor = self.tensors[name]
        try:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, NotImplementedError) as error:
            raise CheckpointError(self.path, f"tensor {name!r}: cannot dequantize {tensor.tensor_type.name} ({error})") from None
        return np.asarray(data).reshape(self.shape(name))


def _parse(buffer: mmap.mmap) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """The metadata (GGUF.* keys left out, as the gguf reader's fields are read) and the tensors."""
    header = _Header(buffer)
    if header.take("4s") != b"GGUF":
        raise ValueError("no GGUF magic")
    version = header.take("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (this reader takes 2 and 3, little-endian)")
    tensor_count, field_count = header.take("Q"), header.take("Q")
    metadata: dict[str, Any] = {}
    for _ in range(field_count):
        key = header.string()
        metadata[key] = header.value(header.take("I"))
    records = []
    for _ in range(tensor_count):
        name = header.string()
        dims = tuple(header.take("Q") for _ in range(header.take("I")))
        records.append((name, Q(header.take("I")), dims, header.take("Q")))
    alignment = int(metadata.get("general.alignment", ALIGNMENT))
    start = -(-header.at // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, kind, dims, offset in records:
        if name in tensors:
            raise ValueError(f"tensor {name!r} listed twice")
        tensors[name] = GGUFTensor(name, kind, dims, _view(buffer, start + offset, kind, dims))
    return metadata, tensors


def _view(buffer: mmap.mmap, offset: int, kind: Q, dims: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes as the gguf reader shapes them (torch order; block formats as bytes a row)."""
    shape = tuple(reversed(dims))
    values = int(np.prod(dims, dtype=np.int64))
    if kind in ELEMENTS:
        dtype, count = np.dtype(ELEMENTS[kind]), values
    else:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        dtype, count = np.dtype(np.uint8), values // block * size
        shape = gguf.quant_shape_to_byte_shape(shape, kind)
    if offset + count * dtype.itemsize > len(buffer):
        raise ValueError("a tensor runs past the end of the file")
    return np.frombuffer(buffer, dtype, count, offset).reshape(shape)
