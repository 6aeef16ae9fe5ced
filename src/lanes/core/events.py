"""A stream's event channel: the lane core sends, one client task receives, and a send never blocks.

It keeps the behaviour of a trio memory channel that the lane core and clients rely on (`receive`,
`receive_nowait`, `aclose`, `async for`; EndOfChannel once the sender has closed and the events are
read; BrokenResourceError for a sender whose receiver has gone) with none of its generality (many
senders and receivers, clones, statistics). Every token of every stream passes through one: a trio
channel cost ~2.7 us more an event (bench/lane_core.py, docs/DECISIONS.md).

Its bound is soft, because the pass loop must never wait on a client: a send that brings the buffer to
`capacity` events says so (the lane core then gives the stream no more rows), and the receive that brings
a full buffer back to half of it calls `on_drain` once (the stream is resumed).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import math
from typing import Callable

import outcome
import trio

T = TypeVar("T")
_EMPTY = object()  # `_next`'s answer when nothing is waiting


class EventChannel(Generic[T]):
    """The two ends in one object: the lane core keeps it as the sender, the client holds it as
    `Stream.events`."""

    __slots__ = ("_items", "_waiter", "_sender_closed", "_receiver_closed", "_capacity", "_on_drain", "_full")

    def __init__(self, capacity: float = math.inf, on_drain: Callable[[], None] | None = None) -> None:
        self._items: deque[T] = deque()
        self._waiter: trio.lowlevel.Task | None = None  # the task blocked in `receive`
        self._sender_closed = False
        self._receiver_closed = False
        self._capacity = capacity
        self._on_drain = on_drain  # called by the receiving task when a full buffer is back to half
        self._full = False  # set by a send that filled the buffer, cleared by the receive that halved it

    # ---- the sender's end (the lane core) ----

    def send_nowait(self, value: T) -> bool:
        """Buffer `value` (or hand it to the waiting receiver); True when the buffer has just become full."""
        if self._sender_closed:
            raise trio.ClosedResourceError("the sender has closed this channel")
        if self._receiver_closed:
            raise trio.BrokenResourceError("the receiver has closed this channel")
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            trio.lowlevel.reschedule(waiter, outcome.Value(value))
            return False
        items = self._items
        items.append(value)
        if len(items) >= self._capacity and not self._full:
            self._full = True
            return True
        return False

    def close_sender(self) -> None:
        """No more events: the receiver reads what is left, then EndOfChannel. Idempotent."""
        if self._sender_closed:
            return
        self._sender_closed = True
        self._wake(trio.EndOfChannel())

    @property
    def receiver_closed(self) -> bool:
        return self._receiver_closed

    @property
    def buffered(self) -> int:
        """Events sent and not yet received."""
        return len(self._items)

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
        items = self._items
        if items:
            value = items.popleft()
            if self._full and len(items) <= self._capacity // 2:
                self._full = False
                if self._on_drain is not None:
                    self._on_drain()
            return value
        if self._sender_closed:
            raise trio.EndOfChannel
        return _EMPTY

    def drain(self) -> list[T]:
        """Every event buffered now, in order, without waiting (none after the last, rather than
        EndOfChannel): a consumer that is behind takes them at once."""
        if self._receiver_closed:
            raise trio.ClosedResourceError("this channel was closed")
        items = self._items
        taken = list(items)
        items.clear()
        if self._full and taken:
            self._full = False
            if self._on_drain is not None:
                self._on_drain()
        return taken

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
