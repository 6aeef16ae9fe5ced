"""Tensors of a Hugging Face folder: one or several safetensors files, read one tensor (or shard) at a time."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError


class SafetensorsSource:
    """A folder's `model.safetensors` or `model.safetensors.index.json` with its shards."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise CheckpointError(index, f"corrupt index ({error})") from None
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = [single.name]
        else:
            found = sorted(p.name for p in folder.glob("*.safetensors"))
            if not found:
                raise CheckpointError(folder, "no model.safetensors or model.safetensors.index.json")
            files = found
        self._handles = {}
        self._where: dict[str, str] = {}
        for name in files:
            path = folder / name
            if not path.is_file():
                raise CheckpointError(path, "missing shard named by the index")
            try:
                handle = safe_open(str(path), framework="pt")
                keys = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as error:
                raise CheckpointError(path, f"truncated or corrupt safetensors file ({error})") from None
            self._handles[name] = handle
            for key in keys:
                self._where[key] = name

    def path_of(self, name: str) -> Path:
        return self.folder / self._where[name]

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def get(self, name: str, *, dim: int | None = None, rank: int = 0, world: int = 1) -> torch.Tensor:
        handle = self._handles[self._where[name]]
        if dim is None or world == 1:
            return handle.get_tensor(name)
        part = handle.get_slice(name)
        size = part.get_shape()[dim]
        if size % world:
            raise ValueError(f"{name}: dimension {dim} of size {size} does not split into {world}")
        step = size // world
        index = [slice(None)] * len(part.get_shape())
        index[dim] = slice(rank * step, (rank + 1) * step)
        return part[tuple(index)]
