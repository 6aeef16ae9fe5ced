"""The lane core's books: the statistics it reports and the integrity check that raises on any broken count."""

from __future__ import annotations

from dataclasses import dataclass

from .blocks import IntegrityError
from .schedule import Phase


@dataclass(frozen=True)
class CoreStats:
    """A snapshot for /metrics and /v1/info."""

    lanes: int
    lanes_busy: int
    lanes_free: int
    queued: int
    max_queue: int
    max_rows: int
    passes: int
    prefill_rows: int
    decode_rows: int
    tokens_out: int
    streams_admitted: int
    streams_finished: int
    streams_cancelled: int
    blocks_total: int
    blocks_free: int




def statistics(core) -> CoreStats:
    """The lane core's counters and occupancy."""
    busy = sum(j is not None for j in core.lanes)
    c = core._counts
    return CoreStats(
        lanes=len(core.lanes), lanes_busy=busy, lanes_free=len(core.lanes) - busy, queued=len(core._queue),
        max_queue=core.max_queue, max_rows=core.limits.max_rows, passes=c["passes"],
        prefill_rows=c["prefill_rows"], decode_rows=c["decode_rows"], tokens_out=c["tokens_out"],
        streams_admitted=c["admitted"], streams_finished=c["finished"], streams_cancelled=c["cancelled"],
        blocks_total=core.pool.total, blocks_free=core.pool.free,
    )

def check_integrity(core) -> None:
    """Raise IntegrityError unless lanes, queue, jobs, the prompt cache and the block pool agree."""
    core.pool.check_integrity()
    if core.cache is not None:
        core.cache.check_integrity()
    seen: set[int] = set()
    for lane, job in enumerate(core.lanes):
        owner = ("lane", lane)
        if job is None:
            if core.pool.held(owner):
                raise IntegrityError(f"free lane {lane} holds blocks {core.pool.held(owner)}")
            continue
        if job.lane != lane or job.table is None or job.table.owner != owner:
            raise IntegrityError(f"lane {lane} holds job {job.id}, which says lane {job.lane}")
        if core.pool.held(owner) != sorted(job.table.blocks):
            raise IntegrityError(f"lane {lane}'s table {job.table.blocks} is not what the pool says it holds")
        if job.done > len(job.table.blocks) * core.pool.block_size:
            raise IntegrityError(f"job {job.id} wrote past its blocks")
        seen.add(job.id)
    for job in core._queue:
        if job.phase is not Phase.QUEUED or job.lane is not None or job.id in seen:
            raise IntegrityError(f"queued job {job.id} is also in a lane or not queued")
        seen.add(job.id)
    seen.update(job.id for job, _ in core._warm)
    if seen != set(core._jobs):
        raise IntegrityError(f"jobs {sorted(set(core._jobs) ^ seen)} are lost or unknown")
