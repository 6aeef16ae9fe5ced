"""A stream's event channel: the lane core sends, one client task receives, and it is never full.

It keeps the behaviour of a trio memory channel that the lane core and clients rely on (`receive`,
`receive_nowait`, `aclose`, `async for`; EndOfChannel once the sender has closed and the events are
read; BrokenResourceError for a sender whose receiver has gone) with none of its generality (many
senders and receivers, clones, a bounded buffer, statistics). Every token of every stream passes
through one: a trio channel cost ~2.7 us more an event (bench/lane_core.py, docs/DECISIONS.md).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import outcome
import trio

T = TypeVar("T")
_EMPTY = object()  # `_next`'s answer when nothing is waiting


class EventChannel(Generic[T]):
    """The two ends in one object: the lane core keeps it as the sender, the client holds it as
    `Stream.events`."""

    __slots__ = ("_items", "_waiter", "_sender_closed", "_receiver_closed")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: trio.lowlevel.Task | None = None  # the task blocked in `receive`
        self._sender_closed = False
        self._receiver_closed = False

    # ---- the sender's end (the lane core) ----

    def send_nowait(self, value: T) -> None:
        if self._sender_closed:
            raise trio.ClosedResourceError("the sender has closed this channel")
        if self._receiver_closed:
            raise trio.BrokenResourceError("the receiver has closed this channel")
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter, outcome.Value(value))
        else:
            self._items.append(value)

    def close_sender(self) -> None:
        """No more events: the receiver reads what is left, then EndOfChannel. Idempotent."""
        if self._sender_closed:
            return
        self._sender_closed = True
        self._wake(trio.EndOfChannel())

    @property
    def receiver_closed(self) -> bool:
        return self._receiver_closed

    # ---- the receiver's end (the client) ----

    def receive_nowait(self) -> T:
        value = self._next()
        if value is _EMPTY:
            raise trio.WouldBlock
        return value

    async def receive(self) -> T:
        """The next event (a checkpoint, as trio's channels); EndOfChannel after the last."""
        await trio.lowlevel.checkpoint_if_cancelled()
        value = self._next()
        if value is not _EMPTY:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return value
        if self._waiter is not None:
            raise trio.BusyResourceError("another task is already receiving from this channel")
        self._waiter = trio.lowlevel.current_task()
        return await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _next(self):
        """The next event waiting, or _EMPTY (no exception: this runs for every token)."""
        if self._receiver_closed:
            raise trio.ClosedResourceError("this channel was closed")
        if self._items:
            return self._items.popleft()
        if self._sender_closed:
            raise trio.EndOfChannel
        return _EMPTY

    def _abort(self, _) -> trio.lowlevel.Abort:
        self._waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def close(self) -> None:
        """The receiver is done (idempotent): events not read are dropped, the sender's next send fails."""
        if self._receiver_closed:
            return
        self._receiver_closed = True
        self._items.clear()
        self._wake(trio.ClosedResourceError("this channel was closed"))

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()

    def _wake(self, error: BaseException) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter, outcome.Error(error))

    def __aiter__(self) -> "EventChannel[T]":
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
