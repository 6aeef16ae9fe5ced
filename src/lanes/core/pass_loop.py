"""The lane core's pass loop: plan a pass, run it on the backend, apply its result and deliver the events;
the pass ahead and fed passes (docs/DECISIONS.md). A part of the lane core (its state, its one task), kept
in a file of its own.
"""

from __future__ import annotations

import trio

from . import schedule
from .schedule import Phase
from .stream import BackendFailed


class PassLoop:
    """Mixed into `LaneCore`, whose lanes, queue, backend, boundary work and delivery these use."""

    async def _pass_loop(self) -> BackendFailed | None:
        # A pass that ran while the one before it was settled: (plan, its jobs, result, the fed pass queued
        # behind it on the device or None).
        ahead = None
        while True:
            if ahead is None:
                self._boundary()
                if self._closing and not any(self.lanes) and not self._queue and not self._warm:
                    return None
                jobs = sorted((j for j in self.lanes if j is not None), key=lambda j: j.id)
                plan = schedule.plan(self._step, jobs, self.limits)
                if not plan.work:
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                self._step += 1
                by_lane = {j.lane: j for j in jobs}
                queued = self._fed_after(plan, by_lane, 1)
                try:
                    result = await self._run(plan, following=queued)
                except Exception as error:
                    return self._failed(error)
                ahead = plan, by_lane, result, queued
            plan, by_lane, result, following = ahead
            ahead = None
            if following is None and self._steady():
                following = schedule.lookahead(self._step, plan, result, by_lane, self._stop_ids)
                self._step += following is not None
            if following is None:
                self._settle(plan, result, by_lane)
                continue
            # The next pass runs on the device while this one's results are applied and delivered (in
            # `started`, called in the event loop as soon as the device has it); where the device feeds, the
            # one after it is queued behind it first.
            behind = self._fed_after(following, by_lane, 2, (plan, result))
            settle = _Settle(self, plan, result, by_lane)
            try:
                next_result = await self._run(following, settle, behind)
            except Exception as error:
                settle()  # the pass before has its result whatever became of this one
                settle.reraise()
                return self._failed(error)
            settle()
            settle.reraise()
            ahead = following, by_lane, next_result, behind

    async def _run(self, plan, started=None, following=None):
        with trio.CancelScope(shield=True):  # the device writes KV into the plan's blocks until the pass ends
            return await self.backend.step(plan, started, following)

    def _fed_after(self, plan, by_lane, unapplied: int, known=None):
        """The pass to queue behind `plan` on a device that feeds it `plan`'s draws (`schedule.fed_after`)."""
        if not (self._feeds and self._steady()):
            return None
        fed = schedule.fed_after(self._step, plan, by_lane, self._stop_ids, unapplied, known)
        self._step += fed is not None
        return fed

    def _failed(self, error: Exception) -> BackendFailed:
        failure = BackendFailed(error)
        failure.__cause__ = error
        self._fail_all(failure)
        return failure

    def _steady(self) -> bool:
        """Only decoding streams and nothing waiting: the next pass can be planned before this one is applied."""
        return self.run_ahead and not (self._closing or self._queue or self._warm or self.decider.busy
                                       or self._prefilling())

    def _prefilling(self) -> bool:
        prefill = Phase.PREFILL
        for job in self.lanes:  # a plain loop: this runs every pass, over every lane
            if job is not None and job.phase is prefill:
                return True
        return False

    def _settle(self, plan, result, by_lane) -> None:
        self._count(plan)
        events = schedule.apply(plan, result, by_lane, self._stop_ids)
        for job in by_lane.values() if self.cache is not None else ():  # only the prompt cache restores
            if job.restore is not None and job.done > job.cached:
                self._report_restore(job)  # its first pass over the restored prefix is done
        for job, event in events:
            self._deliver(job, event)

    def _count(self, plan) -> None:
        self._counts["passes"] += 1
        self._counts["prefill_rows"] += plan.prefill_rows
        self._counts["decode_rows"] += plan.decode_rows


class _Settle:
    """A pass's settling as the `started` callback of the pass after it: run once, in the event loop (in
    the stepping task, or as a trio callback when a worker thread launches). A callback must not raise,
    so an error is kept for the pass loop to raise in its own task."""

    __slots__ = ("core", "plan", "result", "by_lane", "ran", "error")

    def __init__(self, core: PassLoop, plan, result, by_lane) -> None:
        self.core, self.plan, self.result, self.by_lane = core, plan, result, by_lane
        self.ran, self.error = False, None

    def __call__(self) -> None:
        if self.ran:
            return
        self.ran = True
        try:
            self.core._settle(self.plan, self.result, self.by_lane)
            self.core._boundary()  # lanes of ended streams free now; admitted work is planned after the pass ahead
        except BaseException as error:  # raised again by `reraise`, in the pass loop's task
            self.error = error

    def reraise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
