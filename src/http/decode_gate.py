"""The server's decode budget: bytes of memory and worker slots that a media part reserves before it is read
or decoded off the event loop, granted strictly first come, first served.

A request reserves for one part at a time, so another client's part waits behind at most one part of each
request ahead of it, never behind a whole request's queue of parts. The head of the queue is never
overtaken: a large part is not starved by a stream of small ones.
"""

from __future__ import annotations

import os
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

import trio

DEFAULT_BUDGET = 4 << 30  # above the largest image's cost (a 64 Mpx RGBA PNG: ~0.9 GiB), a few at once
DEFAULT_SLOTS = min(4, os.cpu_count() or 1)  # decoding is CPU work: more threads than cores only queue inside


@dataclass(frozen=True)
class GateStatistics:
    budget_bytes: int
    slots: int
    held_bytes: int  # reserved by the parts being read or decoded now
    running: int
    waiting: int


@dataclass(eq=False)
class _Waiter:
    cost: int
    granted: trio.Event  # set by _grant once its cost is reserved


class DecodeGate:
    """`hold(cost)` waits for a slot and `cost` bytes of the budget, in arrival order, and gives both back when
    its block ends. The gate is the one owner of its counts; they change only on the Trio thread."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET, slots: int = DEFAULT_SLOTS) -> None:
        if budget_bytes <= 0 or slots <= 0:
            raise ValueError(f"a decode gate needs a positive budget and slots, got {budget_bytes} and {slots}")
        self.budget_bytes = budget_bytes
        self.slots = slots
        self._held: dict[int, int] = {}  # id of a granted waiter -> its cost
        self._queue: deque[_Waiter] = deque()

    def fits(self, cost: int) -> bool:
        """Whether a part of `cost` bytes can ever be granted (the budget is the most one part may hold)."""
        return cost <= self.budget_bytes

    @asynccontextmanager
    async def hold(self, cost: int) -> AsyncIterator[None]:
        """Reserve a slot and `cost` bytes (which must fit) for the block; cancellable while waiting."""
        if not self.fits(cost):
            raise ValueError(f"a cost of {cost} bytes never fits a budget of {self.budget_bytes}")
        waiter = _Waiter(cost, trio.Event())
        self._queue.append(waiter)
        self._grant()
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():
                self._release(waiter)  # granted in the same step the wait was cancelled
            else:
                self._queue.remove(waiter)
                self._grant()  # the head may have been this one
            raise
        try:
            yield
        finally:
            self._release(waiter)

    def _grant(self) -> None:
        while self._queue and len(self._held) < self.slots:
            head = self._queue[0]
            if sum(self._held.values()) + head.cost > self.budget_bytes:
                return
            self._queue.popleft()
            self._held[id(head)] = head.cost
            head.granted.set()

    def _release(self, waiter: _Waiter) -> None:
        del self._held[id(waiter)]
        self._grant()

    def statistics(self) -> GateStatistics:
        return GateStatistics(self.budget_bytes, self.slots, sum(self._held.values()), len(self._held), len(self._queue))

    def check_integrity(self) -> None:
        """Raise AssertionError unless the grants respect the slots and the budget and nothing granted waits."""
        held = sum(self._held.values())
        assert len(self._held) <= self.slots, (len(self._held), self.slots)
        assert held <= self.budget_bytes, (held, self.budget_bytes)
        assert all(not w.granted.is_set() and id(w) not in self._held for w in self._queue)
        if self._queue:  # the head waits only for a slot or for bytes
            assert len(self._held) == self.slots or held + self._queue[0].cost > self.budget_bytes
