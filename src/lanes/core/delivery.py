"""The lane core's jobs and their streams: a request made a job, its stream's channel opened, its events
delivered and its last one given. A part of the lane core (its state, its one task), kept in a file of
its own.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import trio

from .commands import Resume
from .events import EventChannel
from .media import check_media
from .schedule import Job, Phase
from .stream import EmptyPrompt, EngineError, Failed, Finished, PromptTooLong, Request, ShuttingDown, Stream, TokenEvent


class Delivery:
    """Mixed into `LaneCore`, whose ids, pool, channels, jobs, queue, lanes and counts these use."""

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

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
        room = min(self.max_model_len, self.pool.total * self.pool.block_size)
        # max_tokens 0: the prompt is prefilled (with its logprobs, if asked) and nothing is drawn
        needed = len(prompt) + (sampling.max_tokens != 0)
        if needed > room:
            raise PromptTooLong(needed, room)
        limit = room if sampling.max_tokens is None else len(prompt) + sampling.max_tokens
        if limit > room:
            raise PromptTooLong(limit, room)
        check_media(len(prompt), request.media)
        job = Job(self._take_id(), "stream", prompt, sampling, limit, deadline=request.deadline, media=tuple(request.media))
        job.stops = stops
        job.text = self._text(prompt, sampling)
        return job

    def _open(self, job: Job) -> Stream:
        # Delivery never blocks the pass loop: a consumer that falls behind pauses its stream instead.
        channel = EventChannel(self.stream_buffer, partial(self._send_resume, job.id))
        self._channels[job.id] = channel
        self._jobs[job.id] = job
        return Stream(job.id, channel, self.cancel)

    def _deliver(self, job: Job, event) -> None:
        channel = self._channels.get(job.id)
        if channel is None:
            return
        try:
            if channel.send_nowait(event):
                job.paused = True  # its consumer is `stream_buffer` events behind: no rows until it reads
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            job.cancelled = True  # the consumer went away; its lane is freed at the next boundary
            self._close(job)
            return
        if type(event) is TokenEvent:
            self._counts["tokens_out"] += 1
        elif isinstance(event, (Finished, Failed)):
            self._close(job)

    def _send_resume(self, stream_id: int) -> None:
        """Called by a paused stream's consumer once it has read its buffer down."""
        try:
            self._send(Resume(stream_id))
        except ShuttingDown:
            pass  # the engine has stopped: the stream ended with it

    def _answer(self, job: Job, event: Finished | Failed) -> None:
        """Give a job its last event (if it has none yet); its lane, if any, is freed at the next boundary."""
        if job.outcome is None:
            job.outcome = event
            self._deliver(job, event)
        if job.phase is Phase.QUEUED:
            self._jobs.pop(job.id, None)

    def _close(self, job: Job) -> None:
        channel = self._channels.pop(job.id, None)
        if channel is not None:
            channel.close_sender()

    def _fail_all(self, error: EngineError) -> None:
        self.decider.fail_all(error)
        for job in list(self._queue):
            self._answer(job, Failed(error))
        self._queue.clear()
        for job, reply in self._warm:
            self._jobs.pop(job.id, None)
            reply.fail(error)
        self._warm.clear()
        for lane, job in enumerate(self.lanes):
            if job is not None:
                if job.kind == "warm":
                    job.cancelled = True
                else:
                    self._answer(job, Failed(error))
                self._unbind(lane, job)
