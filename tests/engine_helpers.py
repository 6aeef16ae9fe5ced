"""Running a lane core in a test: start it in a nursery, collect streams, check integrity at the end."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from lanes.core.backend import BackendWrapper
from lanes.core.fake import EOS, FakeBackend, fake_text
from lanes.core.lane_core import LaneCore
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Failed, Finished, Request, TokenEvent


@dataclass
class Outcome:
    tokens: list[int]
    text: str
    last: Finished | Failed
    events: list


async def collect(stream) -> Outcome:
    events = [event async for event in stream.events]
    tokens = [e.token for e in events if isinstance(e, TokenEvent)]
    text = "".join(e.text for e in events if isinstance(e, (TokenEvent, Finished)))
    assert isinstance(events[-1], (Finished, Failed)), events[-1:]
    assert all(not isinstance(e, (Finished, Failed)) for e in events[:-1])
    return Outcome(tokens, text, events[-1], events)


def greedy(max_tokens: int = 8, **more) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **more)


def seeded(seed: int, max_tokens: int = 8, **more) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=max_tokens, **more)


@asynccontextmanager
async def running(backend, text=fake_text, stop_ids=(EOS,), bound: float = 60, **options):
    """A lane core running in its own nursery, for at most `bound` seconds (benches: no bound); on exit it
    is shut down and its books must balance."""
    core = LaneCore(backend, text, stop_ids, **options)
    with trio.fail_after(bound):
        async with trio.open_nursery() as nursery:
            await nursery.start(core.run)
            core.check_integrity()
            try:
                yield core
            except BaseException:
                if isinstance(backend, Gated):
                    backend.open()  # a test that failed midway must not leave a pass held forever
                nursery.cancel_scope.cancel()
                raise
            await core.shutdown(0)
    core.check_integrity()
    assert core.pool.free == core.pool.total, core.pool.statistics()
    assert all(job is None for job in core.lanes)


async def solo(request: Request, backend_factory=FakeBackend, **options) -> Outcome:
    """The request alone on a fresh engine."""
    backend = backend_factory()
    async with running(backend, **options) as core:
        return await collect(await core.submit(request))


def prompt(n: int, first: int = 2) -> tuple[int, ...]:
    return tuple((first + 7 * i) % 45 + 2 for i in range(n))





class Gated(FakeBackend):
    """A fake whose next pass, once `hold()` is called, waits inside the backend until the test releases it."""

    _gate: tuple[trio.Event, trio.Event] | None = None

    def hold(self) -> tuple[trio.Event, trio.Event]:
        """(entered, release): `entered` is set when the next pass is inside the backend; set `release` to let it end."""
        self._gate = (trio.Event(), trio.Event())
        return self._gate

    def open(self) -> None:
        """Let every held pass through and hold none after."""
        self._held_release.set()

    _held_release: trio.Event | None = None

    async def step(self, plan, started=None, following=None):
        if self._held_release is None:
            self._held_release = trio.Event()
        gate, self._gate = self._gate, None
        if gate is not None:
            entered, release = gate
            entered.set()  # set here, inside the held pass; the test waits for it
            async with trio.open_nursery() as either:
                async def until(event):
                    await event.wait()
                    either.cancel_scope.cancel()
                either.start_soon(until, release)
                either.start_soon(until, self._held_release)
        return await super().step(plan, started, following)


def lanes_of(plan) -> list[tuple[int, int, int]]:
    """(lane, start, rows) for each piece of a plan, in order."""
    return [(w.piece.lane, w.piece.start, len(w.piece.tokens)) for w in plan.work]


class Checked(BackendWrapper):
    """Checks the lane core's books after every pass."""

    core = None

    async def step(self, plan, started=None, following=None):
        result = await self.inner.step(plan, started, following)
        if self.core is not None:  # None where the protocol test drives the wrapper alone
            self.core.check_integrity()
        return result
