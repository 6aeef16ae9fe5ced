"""Delivery: every stream's event channel, and the one sender on each.

A stream's events go out as the lane table makes them; a consumer that has gone cancels its stream, one
that falls `stream_buffer` events behind pauses it (its channel calls back, through the mailbox, once it
has read half of them: `Resume`). A job's last event is given once (`answer`).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import trio

from .events import EventChannel
from .job import Job
from .lanes import LaneTable
from .stream import Failed, Finished, Stream, TokenEvent


class Delivery:
    def __init__(self, lanes: LaneTable, stream_buffer: int, resume: Callable[[int], None],
                 cancel: Callable[[int], None]) -> None:
        self._lanes = lanes
        self._buffer = stream_buffer  # events a consumer may fall behind before its stream pauses
        self._resume, self._cancel = resume, cancel  # the lane core's mailbox, for a stream's consumer
        self._channels: dict[int, EventChannel] = {}
        self.tokens_out = 0

    def open(self, job: Job) -> Stream:
        """A stream's channel: its consumer holds the returned Stream."""
        channel = EventChannel(self._buffer, partial(self._resume, job.id))
        self._channels[job.id] = channel
        return Stream(job.id, channel, self._cancel)

    def send(self, job: Job, event) -> None:
        channel = self._channels.get(job.id)
        if channel is None:
            return
        try:
            if channel.send_nowait(event):
                self._lanes.pause(job, True)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._lanes.cancel(job)  # the consumer went away; its lane is freed at the next boundary
            self._close(job)
            return
        if type(event) is TokenEvent:
            self.tokens_out += 1
        elif isinstance(event, (Finished, Failed)):
            self._close(job)

    def answer(self, job: Job, event: Finished | Failed) -> None:
        """Give a job its last event, if it has none yet; its lane, if any, is freed at the next boundary."""
        if self._lanes.end(job, event):
            self.send(job, event)

    def consumer_gone(self, job: Job) -> bool:
        channel = self._channels.get(job.id)
        return channel is not None and channel.receiver_closed

    def _close(self, job: Job) -> None:
        channel = self._channels.pop(job.id, None)
        if channel is not None:
            channel.close_sender()
