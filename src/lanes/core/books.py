"""The lane core's books: the statistics it reports and the integrity check that raises on any broken count.
Both read the components' public state; neither writes any."""

from __future__ import annotations

from dataclasses import dataclass

from .blocks import BlockPool, IntegrityError
from .job import Phase
from .drafting import DraftStats
from .prompt_cache import CacheStats, PromptCache


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
    context_room: int  # the most tokens a stream may span (the model's length, or the KV pool's)
    jobs_held: int  # streams, warm passes and decision prefills the engine holds (queued or in lanes)
    cache: CacheStats | None = None  # the prompt cache's, when there is one
    drafts: DraftStats | None = None  # drafting's, when the lane core drafts


def statistics(core, lanes, admission, delivery, passes, drafting) -> CoreStats:
    """The lane core's counters and occupancy."""
    slots = lanes.slots
    busy = sum(job is not None for job in slots)
    pool = core.pool
    return CoreStats(
        lanes=len(slots), lanes_busy=busy, lanes_free=len(slots) - busy, queued=len(admission.queue),
        max_queue=admission.max_queue, max_rows=passes.limits.max_rows, passes=passes.passes,
        prefill_rows=passes.prefill_rows, decode_rows=passes.decode_rows, tokens_out=delivery.tokens_out,
        streams_admitted=admission.admitted, streams_finished=lanes.finished,
        streams_cancelled=lanes.ended + core.withdrawn, blocks_total=pool.total, blocks_free=pool.free,
        context_room=core.context_room, jobs_held=len(admission.jobs),
        cache=core.cache.statistics() if core.cache is not None else None,
        drafts=drafting.statistics() if drafting is not None else None,
    )


def check_integrity(pool: BlockPool, cache: PromptCache | None, lanes, admission) -> None:
    """Raise IntegrityError unless lanes, queue, jobs, the prompt cache and the block pool agree."""
    pool.check_integrity()
    if cache is not None:
        cache.check_integrity()
    seen: set[int] = set()
    for lane, job in enumerate(lanes.slots):
        owner = ("lane", lane)
        if job is None:
            if pool.held(owner):
                raise IntegrityError(f"free lane {lane} holds blocks {pool.held(owner)}")
            continue
        if job.lane != lane or job.table is None or job.table.owner != owner:
            raise IntegrityError(f"lane {lane} holds job {job.id}, which says lane {job.lane}")
        if pool.held(owner) != sorted(job.table.blocks):
            raise IntegrityError(f"lane {lane}'s table {job.table.blocks} is not what the pool says it holds")
        if job.done > len(job.table.blocks) * pool.block_size:
            raise IntegrityError(f"job {job.id} wrote past its blocks")
        seen.add(job.id)
    for job in admission.queue:
        if job.phase is not Phase.QUEUED or job.lane is not None or job.id in seen:
            raise IntegrityError(f"queued job {job.id} is also in a lane or not queued")
        seen.add(job.id)
    seen.update(job.id for job, _ in admission.warm)
    if seen != set(admission.jobs):
        raise IntegrityError(f"jobs {sorted(set(admission.jobs) ^ seen)} are lost or unknown")
