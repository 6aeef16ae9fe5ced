"""The lane core: one Trio actor that owns the lanes, their jobs and block tables, and runs the pass loop.

Handlers talk to it through its mailbox (`submit`, `cancel`, `warm`, `adopt_prefilled`, `shutdown`); the
inbox task answers at once, the pass loop admits work at pass boundaries: plan, run the pass on the
backend, apply, free what finished, admit what waits.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from typing import Callable, Sequence

import trio

from .blocks import BlockPool, BlockTable, blocks_for
from . import books, schedule
from .books import CoreStats, IntegrityError  # noqa: F401  (re-exported)
from .backend import Backend
from .commands import Adopt, Cancel, CancelDecision, Decide, Reply, Resume, Shutdown, Submit, Warm, WarmCancelled, WarmResult
from .admission import CacheAdmission
from .decider import Decider, DecisionRequest, DecisionResult
from .delivery import Delivery
from .events import EventChannel
from .pass_loop import PassLoop
from .sampling import InvalidParameter, SamplingParams
from .prompt_cache import PromptCache
from .schedule import Job, Limits, Phase
from .stream import BackendFailed, EngineError, Failed, Finished, PromptTooLong, QueueFull, QueueTimeout, Request, ShuttingDown, Stream

TextFactory = Callable[[Sequence[int], SamplingParams], object]


class LaneCore(CacheAdmission, PassLoop, Delivery):
    """Continuous batching over `backend.shape.lanes` lanes. Start it with `await nursery.start(core.run)`."""

    def __init__(self, backend: Backend, text: TextFactory, stop_ids: Sequence[int], *, max_rows: int = 256,
                 max_queue: int = 64, lanes: int | None = None, seeds: Callable[[], int] | None = None,
                 cache_bytes: int = 0, max_decisions: int = 64, decisions_idle_only: bool = False,
                 run_ahead: bool = True, stream_buffer: int = 256) -> None:
        shape = backend.shape
        self.backend = backend
        self.pool = BlockPool(shape.blocks, shape.block_size)
        # The prompt cache is state the lane core alone touches, like the pool (docs/DECISIONS.md says why).
        self.cache = PromptCache(self.pool, cache_bytes, shape.bytes_per_block) if cache_bytes > 0 else None
        self.decider = Decider(self, max_decisions, idle_only=decisions_idle_only)
        self.limits = Limits(max_rows=max_rows)
        self.max_queue = max_queue
        self.stream_buffer = stream_buffer  # events a consumer may fall behind before its stream pauses
        self.run_ahead = run_ahead  # plan the next decode pass before applying the last (docs/DECISIONS.md)
        self._feeds = shape.feeds  # the device can queue a decode pass fed by the draws of the one before
        self.max_model_len = shape.max_model_len
        self.lanes: list[Job | None] = [None] * (lanes or shape.lanes)
        self._text = text
        self._stop_ids = frozenset(stop_ids)
        self._seeds = seeds or (lambda: secrets.randbits(63))
        self._queue: deque[Job] = deque()  # streams waiting for a lane, in arrival order
        self._warm: deque[tuple[Job, Reply]] = deque()  # warm passes waiting for a quiet engine
        self._warm_running: dict[int, Reply] = {}
        self._jobs: dict[int, Job] = {}  # every job not yet answered, by id
        self._channels: dict[int, EventChannel] = {}
        self._next_id = 1
        self._step = 0
        self._closing = False
        self._grace_deadline = math.inf
        self._stopped = trio.Event()  # set by run() when the pass loop has ended
        self._wake = trio.Event()  # set by the inbox and by timers: the pass loop has something to look at
        self._queue_changed = trio.Event()  # set when the queue's deadlines may have changed
        self._inbox_send, self._inbox = trio.open_memory_channel(math.inf)
        self._counts = dict(passes=0, prefill_rows=0, decode_rows=0, tokens_out=0, admitted=0, finished=0, cancelled=0)

    # ---- the mailbox (called by handlers) ----

    async def submit(self, request: Request) -> Stream:
        """Queue a stream; raises QueueFull, PromptTooLong, InvalidParameter or ShuttingDown at once."""
        return await self._ask(Submit(request, Reply()))

    def cancel(self, stream_id: int) -> None:
        """Stop a stream (idempotent): a queued one is removed, a live one frees its lane at the next boundary."""
        self._send(Cancel(stream_id))

    async def warm(self, prompt: Sequence[int], *, into_cache: bool = False) -> WarmResult:
        """Prefill `prompt` when the engine is quiet; raises WarmCancelled if a newer request comes first.
        With `into_cache`, its full blocks go to the prompt cache rather than to the caller."""
        return await self._ask(Warm(tuple(prompt), Reply(), into_cache))

    async def decide(self, request: DecisionRequest) -> DecisionResult:
        """Run a decision beside the live streams; raises QueueFull, DecisionTimeout or ShuttingDown.
        A caller cancelled while it waits cancels the decision (its lanes free at the next boundary)."""
        command = Decide(request, Reply(), object())
        self._send(command)
        try:
            return await command.reply.wait()
        finally:
            if not command.reply.delivered and command.reply.error is None:
                try:
                    self._send(CancelDecision(command.key))
                except ShuttingDown:
                    pass  # the engine has stopped: the decision ended with it

    async def adopt_prefilled(self, request: Request, blocks: Sequence[int], owner, first_token: int) -> Stream:
        """Take over a stream whose prompt a driver prefilled into `blocks` (held by `owner`, handed over here)."""
        return await self._ask(Adopt(request, tuple(blocks), owner, first_token, Reply()))

    def begin_shutdown(self, grace: float) -> None:
        """Stop admission, fail what waits, let live streams finish for `grace` seconds (returns at once)."""
        try:
            self._send(Shutdown(grace))
        except ShuttingDown:
            pass  # already stopped: nothing left to shut down

    async def shutdown(self, grace: float) -> None:
        """`begin_shutdown`, then wait until the lane core has stopped."""
        self.begin_shutdown(grace)
        await self._stopped.wait()

    def _send(self, command) -> None:
        try:
            self._inbox_send.send_nowait(command)
        except trio.ClosedResourceError:
            raise ShuttingDown() from None

    async def _ask(self, command):
        reply = command.reply
        self._send(command)
        try:
            return await reply.wait()
        finally:
            if reply.value is not None and not reply.delivered:
                # The asker was cancelled after the core had answered: nobody will read the stream.
                if isinstance(reply.value, Stream):
                    self.cancel(reply.value.id)
                elif isinstance(reply.value, WarmResult) and reply.value.owner is not None:
                    self.pool.release(reply.value.owner)

    # ---- the actor ----

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run until shut down; raises BackendFailed (after failing every waiter) if a pass fails."""
        failure: BackendFailed | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._inbox_loop)
                nursery.start_soon(self._deadline_loop)
                task_status.started(self)
                try:
                    failure = await self._pass_loop()
                finally:
                    nursery.cancel_scope.cancel()
            if failure is not None:
                raise failure from failure.__cause__
        finally:
            self._closing = True
            self._inbox_send.close()
            self._fail_all(ShuttingDown())
            if self.cache is not None:
                self.cache.clear()  # every restore has reported by now, so every block goes back
            self._refuse_unread_commands()
            self._stopped.set()

    def _refuse_unread_commands(self) -> None:
        while True:
            try:
                command = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            reply = getattr(command, "reply", None)
            if reply is not None:
                reply.fail(ShuttingDown())

    async def _inbox_loop(self) -> None:
        async for command in self._inbox:
            handle = getattr(self, f"_on_{type(command).__name__.lower()}")
            handle(command)
            self._wake.set()

    async def _deadline_loop(self) -> None:
        while True:
            self._queue_changed = trio.Event()
            earliest = min(min((j.deadline for j in self._queue), default=math.inf), self.decider.earliest_deadline())
            with trio.move_on_at(min(earliest, self._grace_deadline)):
                await self._queue_changed.wait()
                continue
            now = trio.current_time()
            self.decider.expire(now)
            for job in [j for j in self._queue if j.deadline <= now]:
                self._queue.remove(job)
                self._answer(job, Failed(QueueTimeout()))
            if now >= self._grace_deadline:
                self._grace_deadline = math.inf
                self.decider.fail_all(ShuttingDown())  # cancels its trunks and branches in lanes
                for job in self.lanes:
                    if job is not None and job.outcome is None and job.kind == "stream":
                        self._answer(job, Failed(ShuttingDown()))
                    elif job is not None and job.kind == "warm":
                        job.cancelled = True
            self._wake.set()

    # ---- commands (run by the inbox task, between checkpoints) ----

    def _on_submit(self, command: Submit) -> None:
        try:
            job = self._new_job(command.request)
        except (EngineError, InvalidParameter) as error:
            command.reply.fail(error)
            return
        if self._closing:
            command.reply.fail(ShuttingDown())
            return
        free = sum(lane is None for lane in self.lanes)
        if len(self._queue) >= self.max_queue + free:  # the queue also holds jobs about to take free lanes
            command.reply.fail(QueueFull(max(0, len(self._queue) - free)))
            return
        self._yield_warm()
        command.reply.set(self._open(job))
        self._queue.append(job)
        self._queue_changed.set()

    def _on_adopt(self, command: Adopt) -> None:
        try:
            job = self._new_job(command.request)
        except (EngineError, InvalidParameter) as error:
            command.reply.fail(error)
            return
        free = [i for i, j in enumerate(self.lanes) if j is None]
        need = blocks_for(job.capacity, self.pool.block_size) - len(command.blocks)
        if self._closing or not free or not self.pool.can_allocate(need):
            command.reply.fail(ShuttingDown() if self._closing else QueueFull(len(self._queue)))
            return
        self._yield_warm()
        stream = self._open(job)
        table = self._bind(job, free[0])
        table.adopt(self.pool, command.blocks, len(command.blocks) * self.pool.block_size)
        self.pool.release(command.owner)
        table.reserve(self.pool, job.capacity)
        job.done, job.phase = len(job.prompt), Phase.DECODE
        command.reply.set(stream)
        for event in schedule.take_first(job, command.first_token, self._stop_ids):
            self._deliver(job, event)

    def _on_warm(self, command: Warm) -> None:
        if self._closing:
            command.reply.fail(ShuttingDown())
            return
        limit = len(command.prompt)
        if not command.prompt or limit > self.max_model_len or blocks_for(limit) > self.pool.total:
            command.reply.fail(PromptTooLong(limit, min(self.max_model_len, self.pool.total * self.pool.block_size)))
            return
        job = Job(self._take_id(), "warm", command.prompt, SamplingParams(), limit)
        job.into_cache = command.into_cache
        self._jobs[job.id] = job
        self._warm.append((job, command.reply))

    def _on_cancel(self, command: Cancel) -> None:
        job = self._jobs.get(command.stream_id)
        if job is None or job.kind != "stream":
            return  # unknown, already answered, or not a stream: cancel is idempotent
        if job.phase is Phase.QUEUED:
            self._queue.remove(job)
            self._queue_changed.set()
            self._counts["cancelled"] += 1
            self._answer(job, Finished("cancelled", prompt_tokens=len(job.prompt)))
        else:
            job.cancelled = True

    def _on_resume(self, command: Resume) -> None:
        job = self._jobs.get(command.stream_id)
        if job is not None:
            job.paused = False

    def _on_decide(self, command: Decide) -> None:
        if self._closing:
            command.reply.fail(ShuttingDown())
            return
        self.decider.submit(command.request, command.reply, command.key, self._take_id())
        self._queue_changed.set()  # its deadline counts now

    def _on_canceldecision(self, command: CancelDecision) -> None:
        self.decider.cancel(command.key)

    def _on_shutdown(self, command: Shutdown) -> None:
        if not self._closing:
            self._closing = True
            self._grace_deadline = trio.current_time() + command.grace
            self._queue_changed.set()
        for job in list(self._queue):
            self._answer(job, Failed(ShuttingDown()))
        self._queue.clear()
        for decision in list(self.decider.queue):
            self.decider.fail(decision, ShuttingDown())
        self._yield_warm()

    # ---- boundary work (run by the pass loop between passes) ----

    def _boundary(self) -> None:
        decode, uncached = Phase.DECODE, self.cache is None
        for lane, job in enumerate(self.lanes):
            if job is None or (job.phase is decode and not job.cancelled and job.outcome is None
                               and (uncached or job.kept)):
                continue  # free, or a stream under way whose prompt is kept: most lanes, every pass
            if self.cache is not None and job.kind == "stream" and not job.kept and job.done >= len(job.prompt):
                job.kept = True
                full = len(job.prompt) // self.pool.block_size
                self.cache.keep(job.key[: full * self.pool.block_size], job.table.blocks[:full])
            # A decoding stream is sent an event every pass, which finds a closed consumer; others are asked.
            channel = self._channels.get(job.id) if job.phase is not Phase.DECODE else None
            if channel is not None and channel.receiver_closed and job.outcome is None:
                job.cancelled = True  # the consumer closed its end
            if job.cancelled or job.outcome is not None:
                self._unbind(lane, job)
        self._admit()

    def _admit(self) -> None:
        if not (self._queue or self._warm or self.decider.busy):
            return  # nothing waits for a lane (the common case, every pass)
        free = [i for i, j in enumerate(self.lanes) if j is None]
        while free and self._queue:
            job = self._queue[0]
            match = self._lookup(job)
            if not self._room_for(blocks_for(job.capacity, self.pool.block_size) - len(match.blocks), match):
                break  # the head waits for blocks; FIFO keeps later arrivals behind it
            self._queue.popleft()
            self._queue_changed.set()
            self._place(job, free.pop(0), match, capacity=job.capacity)
            self._counted(job)
            self._counts["admitted"] += 1
        self.decider.admit_running(free)  # decisions under way finish, and free their trunks' blocks
        if not self._queue:  # a request waiting for a lane goes before any decision not yet started
            self.decider.admit_queued(free)
        quiet = not self._queue and not self.decider.busy and not any(j is not None and j.kind == "stream" for j in self.lanes)
        while quiet and free and self._warm:
            job, reply = self._warm[0]
            if not self._room_for(blocks_for(job.limit, self.pool.block_size), None):
                break
            self._warm.popleft()
            self._bind(job, free.pop(0)).reserve(self.pool, job.limit)
            job.phase = Phase.PREFILL
            self._warm_running[job.id] = reply

    def _bind(self, job: Job, lane: int) -> BlockTable:
        job.lane = lane
        job.table = BlockTable(("lane", lane))
        self.lanes[lane] = job
        if job.kind == "stream" or job.media:  # a decision's prefill with images needs their positions and tower
            self.backend.bind(lane, job.prompt, job.sampling, job.media)
        return job.table

    def _unbind(self, lane: int, job: Job) -> None:
        if job.restore is not None:
            self._report_restore(job)
        if job.kind == "warm":
            self._finish_warm(job)
        elif job.kind in ("trunk", "branch"):
            self.decider.unbound(job)
        elif job.outcome is None:
            self._answer(job, Finished("cancelled", prompt_tokens=len(job.prompt), completion_tokens=len(job.generated),
                                       cached_tokens=job.cached))
        if job.kind == "stream" or job.media:  # exactly the jobs `_bind` bound
            self.backend.unbind(lane)
        if job.kind == "stream":
            ended = isinstance(job.outcome, Finished) and job.outcome.reason != "cancelled"
            self._counts["finished" if ended else "cancelled"] += 1
        job.table.clear(self.pool)
        self.lanes[lane] = None
        job.phase = Phase.DONE
        self._jobs.pop(job.id, None)

    def _finish_warm(self, job: Job) -> None:
        reply = self._warm_running.pop(job.id)
        if job.cancelled or job.outcome is None:
            reply.fail(WarmCancelled())
            return
        full = job.done // self.pool.block_size
        tokens, blocks = tuple(job.key[: full * self.pool.block_size]), tuple(job.table.blocks[:full])
        if job.into_cache:
            kept = self.cache is not None and self.cache.keep(tokens, blocks)
            reply.set(WarmResult(tokens, blocks, None, kept=kept))
            return
        owner = ("warm", job.id)
        self.pool.fork(owner, blocks)
        reply.set(WarmResult(tokens, blocks, owner))

    def _yield_warm(self) -> None:
        """A newer request (or shutdown) comes first: every warm pass, waiting or running, is cancelled."""
        for job, reply in self._warm:
            self._jobs.pop(job.id, None)
            reply.fail(WarmCancelled())
        self._warm.clear()
        for job in self.lanes:
            if job is not None and job.kind == "warm":
                job.cancelled = True

    # ---- observation ----

    def statistics(self) -> CoreStats:
        """A snapshot for /metrics and /v1/info."""
        return books.statistics(self)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless lanes, queue, jobs, the prompt cache and the block pool agree."""
        books.check_integrity(self)
