"""Admission: who gets a free lane, and with which blocks.

The one owner of the queue of streams waiting for a lane, the warm passes waiting for a quiet engine, and
the registry of every job the engine holds; and of the prompt cache's side of admission: the prefix a job
restores, its pin until its restore reports (docs/DECISIONS.md), its prompt offered to the cache once run.
At each boundary it gives free lanes to the queue's head (FIFO: a head waiting for blocks is not
overtaken), then to decisions (its `Decider`), then to a warm pass when nothing else wants the engine.
It is the decider's `Placement`: the decider asks for lanes only through it.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Hashable, Iterator, Sequence

from .blocks import BlockPool, blocks_for
from .commands import Reply, WarmCancelled, WarmResult
from .decider import Decider
from .job import Job
from .lanes import LaneTable
from .prompt_cache import Match, Node, PromptCache
from .stream import EngineError, Failed, QueueFull, QueueTimeout, ShuttingDown

NO_MATCH = Match(None, 0, ())


class Admission:
    def __init__(self, lanes: LaneTable, pool: BlockPool, cache: PromptCache | None, answer: Callable,
                 max_queue: int, max_decisions: int, decisions_idle_only: bool = False,
                 restore_fault: Callable[[], bool] | None = None) -> None:
        self._lanes, self._pool, self._cache, self._answer = lanes, pool, cache, answer
        self.block_size = pool.block_size
        self.max_queue = max_queue
        self.queue: deque[Job] = deque()  # streams waiting for a lane, in arrival order
        self.warm: deque[tuple[Job, Reply]] = deque()  # warm passes waiting for a quiet engine
        self._warm_running: dict[int, Reply] = {}
        self.jobs: dict[int, Job] = {}  # every job not yet done, by id (cancel and resume find them here)
        self._restores: dict[int, Node] = {}  # job id -> the cached chain it restores, pinned until it reports
        self._lookups: dict[int, Match] = {}  # job id -> its lookup while it waits, counted once it is placed
        self._restore_fault = restore_fault  # a test's fault: True fails the restore it is asked about
        self._next_id = 1
        self.admitted = 0
        self.decider = Decider(self, max_decisions, idle_only=decisions_idle_only)

    @property
    def caches(self) -> bool:
        return self._cache is not None

    # ---- the registry ----

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def register(self, job: Job) -> None:
        self.jobs[job.id] = job

    def forget(self, job: Job) -> None:
        self.jobs.pop(job.id, None)
        self._lookups.pop(job.id, None)

    # ---- streams ----

    def enqueue(self, job: Job) -> None:
        """Queue a stream; raises QueueFull when `max_queue` wait already (jobs about to take free lanes aside)."""
        free = len(self._lanes.free())
        if len(self.queue) >= self.max_queue + free:
            raise QueueFull(max(0, len(self.queue) - free))
        self.queue.append(job)
        self.register(job)

    def dequeue(self, job: Job) -> None:
        """A queued stream leaves the queue (cancelled, past its deadline, or the engine stopping)."""
        self.queue.remove(job)
        self.forget(job)

    def expired(self, now: float) -> list[Job]:
        return [job for job in self.queue if job.deadline <= now]

    def earliest_deadline(self) -> float:
        return min((job.deadline for job in self.queue), default=float("inf"))

    # ---- warm passes ----

    def add_warm(self, job: Job, reply: Reply) -> None:
        self.warm.append((job, reply))
        self.register(job)

    def yield_warm(self) -> None:
        """A newer request (or shutdown) comes first: every warm pass, waiting or running, is cancelled."""
        for job, reply in self.warm:
            self.forget(job)
            reply.fail(WarmCancelled())
        self.warm.clear()
        for job in self._lanes.slots:
            if job is not None and job.kind == "warm":
                self._lanes.cancel(job)

    def finish_warm(self, job: Job) -> None:
        """A warm pass leaves its lane: its full blocks go to the prompt cache, or it was cancelled."""
        reply = self._warm_running.pop(job.id)
        if job.cancelled or job.outcome is None:
            reply.fail(WarmCancelled())
            return
        full = job.done // self.block_size
        tokens, blocks = tuple(job.key[: full * self.block_size]), tuple(job.table.blocks[:full])
        reply.set(WarmResult(tokens, self._cache is not None and self._cache.keep(tokens, blocks)))

    # ---- the boundary ----

    def admit(self) -> None:
        """Free lanes to the queue's head, decisions, then a warm pass (on a quiet engine)."""
        decider = self.decider
        if not (self.queue or self.warm or decider.busy):
            return  # nothing waits for a lane (the common case, every pass)
        free = self._lanes.free()
        while free and self.queue:
            job = self.queue[0]
            match = self.lookup(job)
            if not self.room_for(blocks_for(job.capacity, self.block_size) - len(match.blocks), match):
                break  # the head waits for blocks; FIFO keeps later arrivals behind it
            self.queue.popleft()
            self._place(job, free.pop(0), match)
            self.admitted += 1
        decider.admit_running(free)  # decisions under way finish, and free their trunks' blocks
        if not self.queue:  # a request waiting for a lane goes before any decision not yet started
            decider.admit_queued(free)
        quiet = not self.queue and not decider.busy and not self.streams_in_lanes()
        while quiet and free and self.warm:
            job, reply = self.warm[0]
            if not self.room_for(blocks_for(job.limit, self.block_size), None):
                break
            self.warm.popleft()
            self._lanes.bind(job, free.pop(0), job.limit)
            self._warm_running[job.id] = reply

    def _place(self, job: Job, lane: int, match: Match) -> None:
        """Bind `job` to `lane` with its restored prefix's blocks, room for its whole context reserved."""
        self._lanes.bind(job, lane, job.capacity, (match.blocks, match.tokens))
        if match.node is not None:
            job.cached = match.tokens
            self._restores[job.id] = match.node
        looked = self._lookups.pop(job.id, None)
        if self._cache is not None and looked is not None:
            self._cache.count_lookup(looked)  # a hit or a miss once, however often it looked while it waited

    # ---- the prompt cache's side ----

    def lookup(self, job: Job) -> Match:
        """The longest cached prefix the job will restore, pinned (none when the restore fails, which falls back
        to a fresh prefill); at least one prompt row is left to run."""
        if self._cache is None or job.sampling.prompt_logprobs:
            return NO_MATCH
        match = self._cache.lookup(job.key[:-1], count=False)  # counted once the job is placed
        self._lookups[job.id] = match
        if match.node is None:
            return match
        self._cache.pin(match.node)
        if match.node.dead or (self._restore_fault is not None and self._restore_fault()):
            self._cache.report(match.node, ok=False)  # a fresh prefill of the same tokens follows
            return NO_MATCH
        return match

    def room_for(self, blocks: int, match: Match | None) -> bool:
        """Whether `blocks` more blocks can be had (cached prefixes give way, pinned ones stay); when not,
        the pin of `match` is let go."""
        if self._cache is not None and not self._pool.can_allocate(blocks):
            self._cache.reclaim(blocks)
        if self._pool.can_allocate(blocks):
            return True
        if match is not None and match.node is not None:
            self._cache.unpin(match.node)
        return False

    def restoring(self, job: Job) -> bool:
        return job.id in self._restores

    def report_restore(self, job: Job) -> None:
        """The job's first pass over its restored prefix is done (or it left its lane): its pin goes."""
        self._cache.report(self._restores.pop(job.id), ok=True)

    def keep_prompt(self, job: Job) -> None:
        """A stream's prompt has run: its full blocks are offered to the prompt cache, once."""
        job.kept = True
        full = len(job.prompt) // self.block_size
        self._cache.keep(job.key[: full * self.block_size], job.table.blocks[:full])

    # ---- the decider's Placement ----

    def place_prefix(self, job: Job, free: list[int]) -> bool:
        """A trunk into `free[0]` (restored from the prompt cache where it can), registered; False when the
        pool has no room for it."""
        match = self.lookup(job)
        if not self.room_for(blocks_for(len(job.prompt), self.block_size) - len(match.blocks), match):
            self._lookups.pop(job.id, None)
            return False
        self._place(job, free.pop(0), match)
        self.register(job)
        return True

    def place_after(self, job: Job, free: list[int], shared: Sequence[int], tokens: int) -> bool:
        """A branch into `free[0]` over `shared`, blocks that hold its first `tokens`; False without room."""
        if not self.room_for(blocks_for(len(job.prompt), self.block_size) - len(shared), None):
            return False
        self._lanes.bind(job, free.pop(0), len(job.prompt), (shared, tokens))
        self.register(job)
        return True

    def hold(self, owner: Hashable, blocks: Sequence[int]) -> None:
        self._pool.fork(owner, blocks)

    def let_go(self, owner: Hashable) -> None:
        self._pool.release(owner)

    def keep(self, key: Sequence, blocks: Sequence[int]) -> None:
        if self._cache is not None:
            self._cache.keep(key, blocks)

    def cancel(self, job: Job) -> None:
        self._lanes.cancel(job)

    def jobs_in_lanes(self) -> Iterator[Job]:
        return (job for job in self._lanes.slots if job is not None)

    def streams_in_lanes(self) -> bool:
        return any(job is not None and job.kind == "stream" for job in self._lanes.slots)

    # ---- the end ----

    def expire(self, now: float) -> None:
        """Queued streams and decisions past their deadlines are answered with their timeouts."""
        self.decider.expire(now)
        for job in self.expired(now):
            self.dequeue(job)
            self._answer(job, Failed(QueueTimeout()))

    def shut(self) -> None:
        """Shutdown: queued streams and decisions not started are refused; warm passes yield."""
        for job in list(self.queue):
            self.dequeue(job)
            self._answer(job, Failed(ShuttingDown()))
        self.decider.fail_queued(ShuttingDown())
        self.yield_warm()

    def fail_waiting(self, error: EngineError) -> None:
        """Everything waiting for a lane gets `error`: decisions, queued streams, warm passes."""
        self.decider.fail_all(error)
        for job in list(self.queue):
            self.dequeue(job)
            self._answer(job, Failed(error))
        for job, reply in self.warm:
            self.forget(job)
            reply.fail(error)
        self.warm.clear()
