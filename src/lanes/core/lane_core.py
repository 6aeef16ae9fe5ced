"""The lane core: one Trio actor that owns the lanes, their jobs and block tables, and runs the pass loop.

Handlers talk to it through its mailbox (`submit`, `cancel`, `warm`, `decide`, `shutdown`); the inbox task
answers at once, the pass loop admits work at pass boundaries. Its state lives in components, each the one
writer of its own: the lane table (lanes and each job's lane state), admission (the queue, warm passes,
the job registry, the prompt cache's pins; its decider the decisions), delivery (the streams' channels)
and the pass loop (passes in flight). docs/MAP.md follows one streaming request through them.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Callable, Sequence

import trio

from . import books, planner
from .admission import Admission
from .backend import Backend
from .blocks import BlockPool, IntegrityError, blocks_for
from .books import CoreStats
from .commands import Cancel, CancelDecision, Decide, Reply, Resume, Shutdown, Submit, Warm, WarmResult
from .decider import DecisionRequest, DecisionResult
from .delivery import Delivery
from .drafting import DraftSource, Drafting
from .job import Job, Phase
from .lanes import LaneTable
from .media import check_media
from .pass_loop import PassLoop
from .prompt_cache import PromptCache
from .sampling import InvalidParameter, SamplingParams
from .stream import (BackendFailed, EmptyPrompt, EngineError, Failed, Finished, PromptTooLong, Request,
                     ShuttingDown, Stream)

TextFactory = Callable[[Sequence[int], SamplingParams], object]


class LaneCore:
    """Continuous batching over `backend.shape.lanes` lanes. Start it with `await nursery.start(core.run)`."""

    def __init__(self, backend: Backend, text: TextFactory, stop_ids: Sequence[int], *, max_rows: int = 256,
                 max_queue: int = 64, lanes: int | None = None, seeds: Callable[[], int] | None = None,
                 cache_bytes: int = 0, max_decisions: int = 64, decisions_idle_only: bool = False,
                 run_ahead: bool = True, stream_buffer: int = 256, drafts: DraftSource | None = None,
                 draft_tokens: int = 4, draft_control: bool = True,
                 restore_fault: Callable[[], bool] | None = None) -> None:
        shape = backend.shape
        self.backend = backend
        self.pool = BlockPool(shape.blocks, shape.block_size)  # read-only outside the lane core: tests, books
        # The prompt cache is state the lane core alone touches, like the pool (docs/DECISIONS.md says why).
        self.cache = PromptCache(self.pool, cache_bytes, shape.bytes_per_block) if cache_bytes > 0 else None
        self._lanes = LaneTable(lanes or shape.lanes, self.pool, backend)
        self._delivery = Delivery(self._lanes, stream_buffer, self._send_resume, self.cancel)
        self._admission = Admission(self._lanes, self.pool, self.cache, self._delivery.answer, max_queue,
                                    max_decisions, decisions_idle_only, restore_fault)
        # Drafting (docs/DECISIONS.md): a source of drafts, up to `draft_tokens` a lane, lengths by load.
        self._drafting = Drafting(drafts, draft_tokens, draft_control) if drafts is not None else None
        self._passes = PassLoop(self._lanes, self._admission, self._delivery, backend,
                                planner.Limits(max_rows=max_rows), run_ahead, self._drafting)
        self.max_model_len = shape.max_model_len
        self._text = text
        self._stop_ids = frozenset(stop_ids)
        self._seeds = seeds or (lambda: secrets.randbits(63))
        self._grace_deadline = math.inf
        self._stopped = trio.Event()  # set by run() when the pass loop has ended
        self._deadlines_changed = trio.Event()  # set when the queue's deadlines may have changed
        self._inbox_send, self._inbox = trio.open_memory_channel(math.inf)
        self.withdrawn = 0  # queued streams cancelled before they took a lane

    @property
    def lanes(self) -> list[Job | None]:
        """Each lane's job (a view for tests and the books; the lane table writes it)."""
        return self._lanes.slots

    @property
    def decider(self):
        """The decider (a view for tests; admission owns it)."""
        return self._admission.decider

    @property
    def context_room(self) -> int:
        """The most tokens a stream may span: the model's length, or the whole KV pool if that is less."""
        return min(self.max_model_len, self.pool.total * self.pool.block_size)

    # ---- the mailbox (called by handlers) ----

    async def submit(self, request: Request) -> Stream:
        """Queue a stream; raises QueueFull, PromptTooLong, InvalidParameter or ShuttingDown at once."""
        return await self._ask(Submit(request, Reply()))

    def cancel(self, stream_id: int) -> None:
        """Stop a stream (idempotent): a queued one is removed, a live one frees its lane at the next boundary."""
        self._send(Cancel(stream_id))

    async def warm(self, prompt: Sequence[int]) -> WarmResult:
        """Prefill `prompt` into the prompt cache when the engine is quiet; raises WarmCancelled if a newer
        request comes first."""
        return await self._ask(Warm(tuple(prompt), Reply()))

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

    def _send_resume(self, stream_id: int) -> None:
        """Called by a paused stream's consumer once it has read its buffer down."""
        try:
            self._send(Resume(stream_id))
        except ShuttingDown:
            pass  # the engine has stopped: the stream ended with it

    async def _ask(self, command):
        reply = command.reply
        self._send(command)
        try:
            return await reply.wait()
        finally:
            if isinstance(reply.value, Stream) and not reply.delivered:
                self.cancel(reply.value.id)  # the asker was cancelled after the core had answered: nobody reads it

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
                    failure = await self._passes.run()
                finally:
                    nursery.cancel_scope.cancel()
            if failure is not None:
                raise failure from failure.__cause__
        finally:
            self._passes.close()
            self._inbox_send.close()
            self._passes.fail_all(ShuttingDown())
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
            match command:
                case Submit():
                    self._on_submit(command)
                case Cancel():
                    self._on_cancel(command)
                case Resume():
                    self._on_resume(command)
                case Warm():
                    self._on_warm(command)
                case Decide():
                    self._on_decide(command)
                case CancelDecision():
                    self._admission.decider.cancel(command.key)
                case Shutdown():
                    self._on_shutdown(command)
            self._passes.wake()

    async def _deadline_loop(self) -> None:
        admission = self._admission
        while True:
            self._deadlines_changed = trio.Event()
            earliest = min(admission.earliest_deadline(), admission.decider.earliest_deadline(), self._grace_deadline)
            with trio.move_on_at(earliest):
                await self._deadlines_changed.wait()
                continue
            now = trio.current_time()
            admission.expire(now)
            if now >= self._grace_deadline:
                self._grace_deadline = math.inf
                admission.decider.fail_all(ShuttingDown())  # cancels its trunks and branches in lanes
                for job in self._lanes.slots:
                    if job is not None and job.outcome is None and job.kind == "stream":
                        self._delivery.answer(job, Failed(ShuttingDown()))
                    elif job is not None and job.kind == "warm":
                        self._lanes.cancel(job)
            self._passes.wake()

    # ---- commands (run by the inbox task, between checkpoints) ----

    def _on_submit(self, command: Submit) -> None:
        try:
            job = self._new_job(command.request)
            if self._passes.closing:
                raise ShuttingDown()
            self._admission.enqueue(job)
        except (EngineError, InvalidParameter) as error:
            command.reply.fail(error)
            return
        self._admission.yield_warm()
        command.reply.set(self._delivery.open(job))
        self._deadlines_changed.set()

    def _new_job(self, request: Request) -> Job:
        """A stream's job: its parameters checked (against the model's vocabulary too), its seed drawn, its
        stop tokens settled (and masked until min_tokens); raises InvalidParameter or an EngineError."""
        sampling = request.sampling
        sampling.validate()
        sampling.check_ids(self.backend.shape.vocab_size)
        if sampling.seed is None:
            sampling = sampling.with_seed(self._seeds())
        stops = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self._stop_ids)
        if sampling.min_tokens:
            sampling = dataclasses.replace(sampling, min_tokens_stops=tuple(sorted(stops)))
        prompt = tuple(request.prompt)
        if not prompt:
            raise EmptyPrompt()
        room = self.context_room
        needed = len(prompt) + (sampling.max_tokens != 0)  # max_tokens 0: the prompt prefilled, nothing drawn
        if needed > room:
            raise PromptTooLong(needed, room)
        limit = room if sampling.max_tokens is None else len(prompt) + sampling.max_tokens
        if limit > room:
            raise PromptTooLong(limit, room)
        check_media(len(prompt), request.media)
        return Job(self._admission.new_id(), "stream", prompt, sampling, limit, deadline=request.deadline,
                   media=tuple(request.media), text=self._text(prompt, sampling), stops=stops)

    def _on_cancel(self, command: Cancel) -> None:
        job = self._admission.jobs.get(command.stream_id)
        if job is None or job.kind != "stream":
            return  # unknown, already answered, or not a stream: cancel is idempotent
        if job.phase is Phase.QUEUED:
            self._admission.dequeue(job)
            self._deadlines_changed.set()
            self.withdrawn += 1
            self._delivery.answer(job, Finished("cancelled", prompt_tokens=len(job.prompt)))
        else:
            self._lanes.cancel(job)

    def _on_resume(self, command: Resume) -> None:
        job = self._admission.jobs.get(command.stream_id)
        if job is not None:
            self._lanes.pause(job, False)

    def _on_warm(self, command: Warm) -> None:
        if self._passes.closing:
            command.reply.fail(ShuttingDown())
            return
        limit = len(command.prompt)
        if not command.prompt or limit > self.max_model_len or blocks_for(limit) > self.pool.total:
            command.reply.fail(PromptTooLong(limit, self.context_room))
            return
        job = Job(self._admission.new_id(), "warm", command.prompt, SamplingParams(), limit)
        self._admission.add_warm(job, command.reply)

    def _on_decide(self, command: Decide) -> None:
        if self._passes.closing:
            command.reply.fail(ShuttingDown())
            return
        self._admission.decider.submit(command.request, command.reply, command.key, self._admission.new_id())
        self._deadlines_changed.set()  # its deadline counts now

    def _on_shutdown(self, command: Shutdown) -> None:
        if not self._passes.closing:
            self._passes.close()
            self._grace_deadline = trio.current_time() + command.grace
            self._deadlines_changed.set()
        self._admission.shut()

    # ---- observation ----

    def statistics(self) -> CoreStats:
        """A snapshot for /metrics and /v1/info."""
        return books.statistics(self, self._lanes, self._admission, self._delivery, self._passes, self._drafting)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless lanes, queue, jobs, the prompt cache and the block pool agree."""
        books.check_integrity(self.pool, self.cache, self._lanes, self._admission)

    def check_stopped(self) -> None:
        """After a clean stop: `check_integrity`, and every block back in the pool (IntegrityError names who
        holds any)."""
        self.check_integrity()
        if self.pool.free != self.pool.total:
            raise IntegrityError(f"blocks still held after the stop: {self.pool.statistics()}")
