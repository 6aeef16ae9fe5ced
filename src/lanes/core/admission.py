"""The prompt cache's side of admission: room for a job's blocks, the prefix it restores, the pin it holds
until its restore reports. A part of the lane core (its state, its one task), kept in a file of its own.
"""

from __future__ import annotations

from .prompt_cache import Match
from .schedule import Job, Phase


class CacheAdmission:
    """Mixed into `LaneCore`, whose `pool`, `cache` and `_bind` these use."""

    def _room_for(self, blocks: int, match: Match | None) -> bool:
        """Whether `blocks` more blocks can be had (cached prefixes give way, pinned ones stay); when not,
        the pin of `match` is let go."""
        if self.cache is not None and not self.pool.can_allocate(blocks):
            self.cache.reclaim(blocks)
        if self.pool.can_allocate(blocks):
            return True
        if match is not None and match.node is not None:
            self.cache.unpin(match.node)
        return False

    def _place(self, job: Job, lane: int, match: Match, capacity: int) -> None:
        """Bind `job` to `lane`, take its restored prefix's blocks, and reserve room for `capacity` tokens."""
        table = self._bind(job, lane)
        if match.node is not None:
            table.adopt(self.pool, match.blocks, match.tokens)
            job.done = job.cached = match.tokens
            job.restore = match.node
        table.reserve(self.pool, capacity)
        job.phase = Phase.PREFILL

    def _lookup(self, job: Job) -> Match:
        """The longest cached prefix the job will restore, pinned (none when the restore fails, which falls back
        to a fresh prefill); at least one prompt row is left to run."""
        if self.cache is None or job.sampling.prompt_logprobs:
            return Match(None, 0, ())
        match = self.cache.lookup(job.key[:-1], count=False)  # counted once the job is placed (`_counted`)
        job.looked_up = match
        if match.node is None:
            return match
        self.cache.pin(match.node)
        if not self._restore(job, match):
            self.cache.report(match.node, ok=False)  # a fresh prefill of the same tokens follows
            return Match(None, 0, ())
        return match

    def _counted(self, job: Job) -> None:
        """A placed job's lookup counts as a hit or a miss once, however often it looked while it waited."""
        if self.cache is not None and job.looked_up is not None:
            self.cache.count_lookup(job.looked_up)
            job.looked_up = None

    def _restore(self, job: Job, match: Match) -> bool:
        """Whether the job can take the cached chain (the place a failed restore is injected in tests)."""
        return not match.node.dead

    def _report_restore(self, job: Job) -> None:
        node, job.restore = job.restore, None
        self.cache.report(node, ok=True)
