"""Collectives across tensor-parallel ranks: what a sharded forward calls where the ranks must agree."""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class Collective(Protocol):
    """Sum and gather across the `world` ranks of one tensor-parallel group; every rank calls in one order."""

    rank: int
    world: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...


class Solo:
    """World 1: nothing to agree on."""

    rank = 0
    world = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return tensor


class ThreadGroup:
    """Ranks as threads of one process (shards on one host, and the sharding tests).

    Each rank calls with its own `member(rank)`; a call returns once every rank has made it. The sum is
    taken in rank order, so every rank gets the same bits.
    """

    def __init__(self, world: int, timeout: float = 60.0) -> None:
        self.world = world
        self._barrier = threading.Barrier(world, timeout=timeout)
        self._slots: list[torch.Tensor | None] = [None] * world

    def member(self, rank: int) -> "_ThreadRank":
        return _ThreadRank(self, rank)

    def _exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = tensor
        self._barrier.wait()
        parts = list(self._slots)  # every slot is written before anyone passes the barrier
        self._barrier.wait()  # nobody overwrites a slot until every rank has read them all
        return parts  # type: ignore[return-value]


class _ThreadRank:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world = group.world

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = self.group._exchange(self.rank, tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self.group._exchange(self.rank, tensor), dim=dim)
