"""Waiting for a launched pass from the event loop: its end is polled once a scheduling round, while the
loop has other work (settling the pass before, waking the streams' consumers), and handed to a worker
thread only when the loop would otherwise block. A pass that ends while the host is still busy (the
host-bound case, many streams) is then read without any thread hop (docs/DECISIONS.md).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import outcome
import trio

T = TypeVar("T")


class Polled(Protocol[T]):
    """A launched pass: `waits` if it has an event to poll (`done`) or wait for (`wait`, blocking); `read`
    then reads it back; `result` is both, for one without an event (its read blocks)."""

    waits: bool

    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def read(self) -> T: ...

    def result(self) -> T: ...


class PassWaiter(trio.abc.Instrument):
    """One waiting task at a time (a runner's passes run in order). Hooked into the run loop as an
    instrument: `before_io_wait` runs once a round, with a timeout of 0 while tasks are runnable."""

    def __init__(self) -> None:
        self._task = self._pending = self._token = None
        self._run = None  # the trio run this instrument is added to (a backend may outlive one)

    async def collect(self, pending: Polled[T], limiter: trio.CapacityLimiter) -> T:
        if not pending.waits:
            return await trio.to_thread.run_sync(pending.result, limiter=limiter)
        if not pending.done():
            root = trio.lowlevel.current_root_task()
            if self._run is not root:
                trio.lowlevel.add_instrument(self)
                self._run = root
            self._task, self._pending = trio.lowlevel.current_task(), pending
            self._token = trio.lowlevel.current_trio_token()
            # Not abortable: the device writes into the pass's blocks until it ends.
            await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        else:  # a checkpoint still: a pass loop that finds every pass done must let the streams' consumers run
            await trio.lowlevel.cancel_shielded_checkpoint()
        return pending.read()

    def before_io_wait(self, timeout: float) -> None:
        task = self._task
        if task is None:
            return
        try:
            done = self._pending.done()
        except BaseException as error:  # an instrument that raises is dropped: the task would never wake
            self._wake(outcome.Error(error), timeout)
            return
        if done:
            self._wake(outcome.Value(None), timeout)
        elif timeout > 0:  # nothing else to run: a worker thread waits for the pass's end
            pending, token = self._pending, self._token
            self._task = self._pending = None
            trio.lowlevel.start_thread_soon(pending.wait, lambda result: token.run_sync_soon(trio.lowlevel.reschedule, task, result))

    def _wake(self, result: outcome.Outcome, timeout: float) -> None:
        task, token = self._task, self._token
        self._task = self._pending = None
        if timeout > 0:  # the loop is about to block: wake it through its wakeup channel
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)
        else:
            trio.lowlevel.reschedule(task, result)
