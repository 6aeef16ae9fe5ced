"""A GGUF file opened once: its metadata as plain Python values and its tensors by GGUF name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .errors import CheckpointError


class GGUFFile:
    """A memory-mapped GGUF file. Raises CheckpointError when it is truncated or not a GGUF file."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(self.path, "no such file")
        try:
            reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError, IndexError, KeyError) as error:
            raise CheckpointError(self.path, f"truncated or corrupt GGUF file ({error})") from None
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except (ValueError, IndexError) as error:
                raise CheckpointError(self.path, f"unreadable metadata {key!r} ({error})") from None
        self.tensors: dict[str, gguf.ReaderTensor] = {t.name: t for t in reader.tensors}
        self._reader = reader

    def release(self) -> None:
        """Drop the mapping and the reader's arrays once every tensor is read (kept: the metadata); about
        the file's size of resident memory, and the reader's parsed arrays beside it."""
        self._reader = None
        self.tensors = {}

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(self.path, "metadata has no general.architecture")
        return arch

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in torch order (GGUF lists dimensions fastest first)."""
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 (or its float type), in torch order, dequantized with the gguf package."""
        tensor = self.tensors[name]
        try:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, NotImplementedError) as error:
            raise CheckpointError(self.path, f"tensor {name!r}: cannot dequantize {tensor.tensor_type.name} ({error})") from None
        return np.asarray(data).reshape(self.shape(name))
