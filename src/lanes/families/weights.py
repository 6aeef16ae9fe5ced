"""A shard's tensors read from a checkpoint onto the device: which part of each tensor a rank keeps
(`Shard`), and the reader every part loads through (shapes checked against the config, one tensor at a time).

Column-parallel linears (q, k, v, gate, up, each expert's gate and up) keep this rank's output rows,
row-parallel ones (o, down, each expert's down) its input columns; the embedding and the head keep this
rank's slice of the vocabulary. Routers, norms and biases after a sum are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..checkpoint.errors import CheckpointError
from ..checkpoint.source import TensorSource
from ..progress import Progress
from ..quant import DenseWeight, Weight, pad_rows, quantized
from .config import ModelConfig


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    world: int = 1

    def check(self, config: ModelConfig) -> None:
        splits = [("attention heads", config.heads), ("intermediate size", config.intermediate_size)]
        if config.moe is not None:
            splits.append(("expert intermediate size", config.moe.intermediate_size))
            if config.moe.shared_size:
                splits.append(("shared expert intermediate size", config.moe.shared_size))
        for what, n in splits:
            if n % self.world:
                raise ValueError(f"{what} ({n}) do not split over {self.world} ranks")
        if config.kv_heads % self.world and self.world % config.kv_heads:
            raise ValueError(f"{config.kv_heads} KV heads neither split over nor replicate across {self.world} ranks")

    @property
    def column(self) -> tuple[int, int]:
        """(part, parts) of a column- or row-parallel tensor this rank reads."""
        return self.rank, self.world

    def kv_heads(self, config: ModelConfig) -> int:
        """KV heads on this rank; fewer KV heads than ranks are replicated, one a rank."""
        return max(1, config.kv_heads // self.world)

    def kv_part(self, config: ModelConfig) -> tuple[int, int]:
        """(part, parts) of the KV projections this rank reads."""
        if config.kv_heads >= self.world:
            return self.rank, self.world
        return self.rank // (self.world // config.kv_heads), config.kv_heads

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """This rank's [first, first + per_rank) slice of the vocabulary, padded to the same size on every rank."""
        per_rank = -(-vocab // self.world)
        return self.rank * per_rank, per_rank


class Reader:
    """Reads named tensors from a source onto the device, checking shapes against the config; one step of
    `progress` a tensor the model holds (an MoE layer's experts, read expert by expert, are one). Matrices
    read as `weight` stay in a GGUF file's block format where the source keeps one, or are quantized
    (`quantize`: "int8" or "int4", `--quantize`); without `keep_blocks` every matrix is a tensor in `dtype`."""

    def __init__(self, source: TensorSource, path: Path, device: torch.device, dtype: torch.dtype, progress: Progress | None,
                 quantize: str | None = None, keep_blocks: bool = True):
        self.source, self.path, self.device, self.dtype, self.progress = source, path, device, dtype, progress
        self.quantize, self.keep_blocks = quantize, keep_blocks
        self.names = set(source.names())

    def has(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str, shape: tuple[int, ...], *, dim: int | None = None, part: tuple[int, int] = (0, 1),
            dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor, or with `dim` the `part[0]`-th of `part[1]` equal slices along it, on the device in the
        model's dtype (or `dtype`)."""
        tensor = self._read(name, shape, dim, part, dtype)
        self._advance()
        return tensor

    def weight(self, name: str, shape: tuple[int, int], *, dim: int | None = None,
               part: tuple[int, int] = (0, 1)) -> Weight:
        """A matrix as `get` slices it, as a `Weight`: the source's own (a GGUF block format kept as it is)
        where it has one, else the tensor, quantized group-wise with `quantize` where its rows are whole groups."""
        own = getattr(self.source, "weight", None)  # the source's own Weight (GGUF blocks), where it has one
        weight = None
        if own is not None:
            self._check(name, shape)
            weight = own(name, dim=dim, rank=part[0], world=part[1], dtype=self.dtype, device=self.device,
                         keep=self.keep_blocks)
        if weight is None:
            tensor = self._read(name, shape, dim, part, torch.float32 if self.quantize else None)
            if self.quantize and tensor.shape[1] % 32 == 0:
                weight = quantized(tensor, self.quantize)
            else:
                weight = DenseWeight(tensor.to(self.dtype))
        self._advance()
        return weight

    def stacked(self, names: Sequence[str], stacked: str, shape: tuple[int, ...], *, dim: int,
                part: tuple[int, int]) -> torch.Tensor:
        """Every expert's tensor of `shape`, sliced along `dim` as `get` slices: [experts, *slice]. Read from
        the stacked tensor `stacked` where the checkpoint has one (GGUF), else expert by expert (`names`)."""
        if self.has(stacked):
            return self.get(stacked, (len(names), *shape), dim=dim + 1, part=part)
        sliced = list(shape)
        sliced[dim] //= part[1]
        out = torch.empty(len(names), *sliced, device=self.device, dtype=self.dtype)
        for expert, name in enumerate(names):
            out[expert] = self._read(name, shape, dim, part, None)
        self._advance()
        return out

    def vocab(self, name: str, config: ModelConfig, shard: Shard) -> Weight:
        """This rank's vocabulary rows, zero-padded to the per-rank size."""
        full = self.weight(name, (config.vocab_size, config.hidden_size))
        first, per_rank = shard.vocab_range(config.vocab_size)
        if first == 0 and per_rank == config.vocab_size:
            return full
        index = torch.arange(first, min(first + per_rank, config.vocab_size), device=self.device)
        return pad_rows(full.rows(index), per_rank)

    def _check(self, name: str, shape: tuple[int, ...]) -> None:
        if name not in self.names:
            raise CheckpointError(self.path, f"missing tensor {name!r}")
        stored = tuple(self.source.shape(name))
        if stored != shape:
            raise CheckpointError(self.path, f"tensor {name!r} has shape {list(stored)}, the config says {list(shape)}")

    def _read(self, name: str, shape: tuple[int, ...], dim: int | None, part: tuple[int, int],
              dtype: torch.dtype | None) -> torch.Tensor:
        self._check(name, shape)
        host = self.source.get(name, dim=dim, rank=part[0], world=part[1]) if dim is not None else self.source.get(name)
        return host.to(device=self.device, dtype=dtype or self.dtype)

    def _advance(self) -> None:
        if self.progress is not None:
            self.progress.advance()
