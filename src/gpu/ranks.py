"""Tensor-parallel ranks over torch.distributed: NCCL (CUDA) or gloo (CPU) for the passes' collectives, and
a gloo control channel on which rank 0 broadcasts each pass's plan to the followers.

Every collective has the group's short timeout, so no rank ever waits out a default of minutes: a rank
that died makes its peers' next collective fail at once (the connection closes) or within the timeout.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class RankError(Exception):
    """Setting up the ranks failed (a usage error: the words say which rank and why)."""


class PeerLost(Exception):
    """A rank stopped answering in the middle of serving: its connection closed or a collective timed out."""


def reason(error: BaseException) -> str:
    """Gloo's and NCCL's words without the source location and the advice that follow them."""
    text = str(error).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(" This is typically caused", 1)[0].strip()


@dataclass(frozen=True)
class RankSpec:
    world: int
    rank: int
    master: str
    port: int


class DistCollective:
    """`Collective` over the passes' process group: sums and concatenating gathers."""

    def __init__(self, rank: int, world: int, group=None) -> None:
        self.rank = rank
        self.world = world
        self.group = group  # the passes' group, with the short timeout

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.contiguous()
        try:
            dist.all_reduce(tensor, group=self.group)
        except RuntimeError as error:
            raise PeerLost(f"rank {self.rank} lost a peer in a collective: {reason(error)}") from None
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        try:
            dist.all_gather(parts, tensor, group=self.group)
        except RuntimeError as error:
            raise PeerLost(f"rank {self.rank} lost a peer in a collective: {reason(error)}") from None
        return torch.cat(parts, dim=dim)


class ControlChannel:
    """Rank 0 sends small typed messages (plans, heartbeats, stop) that every other rank receives in order."""

    def __init__(self, group) -> None:
        self.group = group

    def send(self, message: Any) -> None:
        try:
            dist.broadcast_object_list([message], src=0, group=self.group)
        except RuntimeError as error:
            raise PeerLost(f"rank 0 lost a follower: {reason(error)}") from None

    def receive(self) -> Any:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as error:
            raise PeerLost(f"rank 0 is gone: {reason(error)}") from None
        return box[0]


_startup = None  # a group with a long timeout, only for the barrier after every rank has loaded


# NVLink multicast (NVLS) off unless asked for: on a shared host it can put the GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
JOIN_SECONDS = 120.0  # every rank must have started within this of the first
PASS_SECONDS = 10.0  # ranks run the same pass, so a peer this late is gone (a dead one fails at once)
LOAD_SECONDS = 900.0  # loading a large model's shard from a slow disk


def join(spec: RankSpec, device: torch.device) -> tuple[DistCollective, ControlChannel]:
    """Join the group at the master's address (blocks until every rank has joined, or JOIN_SECONDS).

    Passes and control messages then time out after PASS_SECONDS; loading the model may take longer,
    which `startup_barrier` covers."""
    global _startup
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        for name, value in NO_MULTICAST.items():
            os.environ.setdefault(name, value)
        torch.cuda.set_device(device)  # NCCL's communicator binds the current device
    limit = datetime.timedelta(seconds=PASS_SECONDS)
    try:
        dist.init_process_group(backend, init_method=f"tcp://{spec.master}:{spec.port}", rank=spec.rank,
                                world_size=spec.world, timeout=datetime.timedelta(seconds=JOIN_SECONDS))
        _startup = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=LOAD_SECONDS))
        control = dist.new_group(backend="gloo", timeout=limit)
        data = dist.new_group(backend=backend, timeout=limit)
    except (RuntimeError, ValueError) as error:
        raise RankError(f"rank {spec.rank} of {spec.world} could not join {spec.master}:{spec.port}: {reason(error)}") from None
    return DistCollective(spec.rank, spec.world, data), ControlChannel(control)


def startup_barrier(rank: int) -> None:
    """Wait until every rank has loaded its shard (rank 0 before it serves, followers before they follow)."""
    try:
        dist.barrier(group=_startup)
    except RuntimeError as error:
        raise RankError(f"rank {rank}: a peer failed while loading: {reason(error)}") from None


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
