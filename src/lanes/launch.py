"""Tensor-parallel processes: rank specs from the flags, the launcher that starts ranks above 0 as child
processes of this one (`--tp N` without `--rank`), and the follower's whole life (`--rank R`, R > 0)."""

from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

from .families.weights import Shard
from .followers import follow
from .backend.torch_backend import fast_decode, forward
from .heap import freeze_startup_heap
from .core.blocks import BLOCK_SIZE, blocks_for
from .gpu.device import choose, cuda_device_count
from .gpu.ranks import PASS_SECONDS, RankError, RankSpec, join, leave, startup_barrier
from .loader import load_model
from .models import resolve_model

log = logging.getLogger("lanes.launch")


def rank_spec(args: argparse.Namespace) -> RankSpec | None:
    """The rank this process is, or None for a single-rank server."""
    if args.tp == 1:
        return None
    if args.rank is None or args.master is None or args.master_port is None:
        raise RankError("--tp above 1 needs --rank, --master and --master-port (or neither, to launch every rank here)")
    if not 0 <= args.rank < args.tp:
        raise RankError(f"--rank {args.rank} is outside 0..{args.tp - 1}")
    return RankSpec(args.tp, args.rank, args.master, args.master_port)


def device_of(args: argparse.Namespace, rank: int) -> str:
    """One GPU a rank where there are several; otherwise the device asked for."""
    gpus = cuda_device_count()
    if args.device in ("auto", "cuda") and gpus > 1:
        return f"cuda:{rank % gpus}"
    return args.device


def model_length(args: argparse.Namespace, model) -> int:
    """The context a lane may use: the flag, bounded by the model and the KV pool (the same on every rank)."""
    return min(args.max_model_len, model.config.max_position, model.kv_blocks * BLOCK_SIZE)


def kv_blocks(args: argparse.Namespace) -> int:
    """The same number of KV blocks on every rank (block ids are shared): every lane a whole context."""
    return args.lanes * blocks_for(args.max_model_len)


def follower_main(args: argparse.Namespace) -> int:
    """Join, load this rank's shard, follow rank 0's passes until it says stop; the exit code."""
    spec = rank_spec(args)
    placement = choose(device_of(args, spec.rank), args.dtype)
    comm, control = join(spec, placement.device)
    try:
        model = load_model(resolve_model(args.model), placement, shard=Shard(spec.rank, spec.world), comm=comm,
                           kv_blocks=kv_blocks(args), kv_cache=args.kv_cache, quantize=args.quantize)
        fast = fast_decode(model, args.lanes, model_length(args, model), not args.no_graphs)  # as rank 0 has it
        startup_barrier(spec.rank)
        freeze_startup_heap()
        log.info("rank %d of %d following", spec.rank, spec.world)
        return follow(lambda plan: forward(model.decoder, fast, plan), control)
    finally:
        leave()


def _die_with_parent() -> None:
    """In a child: be killed when the parent dies, so no rank outlives its launcher (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the launcher still terminates its children on every way out it controls


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched_followers(args: argparse.Namespace, argv: list[str]) -> Iterator[argparse.Namespace]:
    """Start ranks 1..N-1 as children on this machine; yields the arguments rank 0 runs with."""
    port = free_port()
    children = []
    for rank in range(1, args.tp):
        command = [sys.executable, "-m", "lanes", *argv, "--rank", str(rank), "--master", "127.0.0.1",
                   "--master-port", str(port)]
        # Their own session: a terminal's Ctrl-C reaches rank 0 alone, which then stops them in order.
        children.append(subprocess.Popen(command, preexec_fn=_die_with_parent, start_new_session=True))
    rank0 = argparse.Namespace(**{**vars(args), "rank": 0, "master": "127.0.0.1", "master_port": port})
    try:
        yield rank0
    finally:
        for rank, child in enumerate(children, start=1):  # a stopped rank 0 told them to exit, a failed one left
            try:
                child.wait(timeout=PASS_SECONDS)
            except subprocess.TimeoutExpired:
                log.warning("rank %d did not exit; terminating it", rank)
                child.terminate()
                try:
                    child.wait(timeout=PASS_SECONDS)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            log.info("rank %d exited with status %d", rank, child.returncode)
