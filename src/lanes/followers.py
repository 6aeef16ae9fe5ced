"""Tensor-parallel followers: rank 0 broadcasts every pass's plan before it runs it; every other rank runs
`follow()`, the same pass on its shard, until rank 0 says stop.

On rank 0, one actor owns the control channel: plans, heartbeats while idle and the final stop all go out
from under one lock, in one order. A follower never reads a clock, samples or decides: it receives a plan
and runs its forward, whose collectives meet rank 0's. If rank 0 dies, the follower's next receive fails
(the connection closes, or the group's timeout passes: heartbeats come every `HEARTBEAT` seconds).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import trio

from .core.backend import BackendWrapper
from .core.plan import PassResult, Plan
from .gpu.ranks import ControlChannel, PeerLost

log = logging.getLogger("lanes.followers")
HEARTBEAT = 2.0


@dataclass(frozen=True)
class Heartbeat:
    step: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class FollowersStats:
    world: int
    state: str  # "up", "stopped", "lost" or "abandoned" (the server failed)
    plans: int
    heartbeats: int


class Followers:
    """Rank 0's side of the control channel: started with `nursery.start(followers.run)`."""

    def __init__(self, control: ControlChannel, world: int) -> None:
        self.control = control
        self.world = world
        self._lock = trio.Lock()  # one order for every message and the pass that follows a plan
        self._state = "up"
        self._plans = 0
        self._heartbeats = 0
        self._last_sent = time.monotonic()
        self._limiter = trio.CapacityLimiter(1)
        self._ended = trio.Event()

    async def _send(self, message) -> None:
        try:
            await trio.to_thread.run_sync(self.control.send, message, limiter=self._limiter)
        except PeerLost:
            self._end("lost")
            raise
        self._last_sent = time.monotonic()

    def _end(self, state: str) -> None:
        self._state = state
        self._ended.set()

    async def run_pass(self, plan: Plan, inner, started=None, following: Plan | None = None) -> PassResult:
        """Broadcast `plan` (and `following`, which ranks run after it), then run it here; the followers
        run it too, meeting in its collectives. (No rank's shape `feeds`, so `following` stays None.)"""
        async with self._lock:
            await self._send(plan)
            self._plans += 1
            if following is not None:
                await self._send(following)
                self._plans += 1
            return await inner.step(plan, started, following)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Heartbeats while idle, so a follower can tell a quiet rank 0 from a dead one."""
        task_status.started(self)
        while self._state == "up":
            with trio.move_on_after(HEARTBEAT):
                await self._ended.wait()
            if self._state == "up" and time.monotonic() - self._last_sent >= HEARTBEAT and not self._lock.locked():
                async with self._lock:
                    await self._send(Heartbeat(self._plans))
                    self._heartbeats += 1

    async def stop(self) -> None:
        """Tell every follower to exit (after the lane core has stopped)."""
        if self._state != "up":
            return
        async with self._lock:
            await self._send(Stop())
            self._end("stopped")

    def abandon(self) -> None:
        """The server is failing: send nothing more (the followers see rank 0 go and exit)."""
        if self._state == "up":
            self._end("abandoned")

    def statistics(self) -> FollowersStats:
        return FollowersStats(self.world, self._state, self._plans, self._heartbeats)


class FollowersBackend(BackendWrapper):
    """Rank 0's backend: every pass goes out to the followers first (see `Followers.run_pass`)."""

    def __init__(self, inner, followers: Followers) -> None:
        super().__init__(inner)
        self.followers = followers

    async def step(self, plan: Plan, started=None, following: Plan | None = None) -> PassResult:
        return await self.followers.run_pass(plan, self.inner, started, following)


def follow(run: Callable[[Plan], object], control: ControlChannel) -> int:
    """Run every pass rank 0 sends until it says stop (0), or until rank 0 is gone (1)."""
    passes = 0
    with torch.inference_mode():
        while True:
            try:
                message = control.receive()
            except PeerLost as error:
                log.error("%s (after %d passes)", error, passes)
                return 1
            if isinstance(message, Stop):
                log.info("stopped by rank 0 after %d passes", passes)
                return 0
            if isinstance(message, Plan):
                try:
                    run(message)
                except PeerLost as error:
                    log.error("pass %d failed: %s", message.step, error)
                    return 1
                passes += 1
