"""A backend wrapper that times every pass (for /metrics and the event-loop test)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .backend import BackendWrapper
from .plan import PassResult, Plan


@dataclass(frozen=True)
class PassTimes:
    passes: int
    seconds_total: float
    seconds_max: float
    seconds_last: float


class MeteredBackend(BackendWrapper):
    """Forwards everything; `step` also measures the pass's wall time (time.perf_counter)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self._times = PassTimes(0, 0.0, 0.0, 0.0)

    async def step(self, plan: Plan, started=None, following: Plan | None = None) -> PassResult:
        start = time.perf_counter()
        try:
            return await self.inner.step(plan, started, following)
        finally:
            took = time.perf_counter() - start
            t = self._times
            self._times = PassTimes(t.passes + 1, t.seconds_total + took, max(t.seconds_max, took), took)

    def statistics(self) -> PassTimes:
        return self._times
