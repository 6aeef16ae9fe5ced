"""The pass loop: plan a pass, run it on the backend, apply its result and deliver its events, and between
passes free what ended and admit what waits. The one owner of the step counter and of the passes in
flight (`InFlight`); it reaches the lanes only through the lane table, admission and delivery.

Overlap (docs/DECISIONS.md): when a pass allows it (`Plan.ahead`) and nothing waits, the next pass is planned
from the result before that is applied, and the result is applied in the `started` callback of the next
pass, while the device runs it; where the backend feeds, a fed pass is queued behind the running one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import trio

from . import planner
from .admission import Admission
from .backend import Backend
from .delivery import Delivery
from .drafting import Drafting
from .job import Job, Phase
from .lanes import LaneTable
from .plan import PassResult, Plan
from .stream import BackendFailed, EngineError, Failed, Finished


@dataclass(frozen=True)
class InFlight:
    """A pass stepped whose result is not applied yet, and the fed pass queued behind it on the device."""

    plan: Plan
    by_lane: dict[int, Job]
    result: PassResult
    queued: Plan | None


class PassLoop:
    def __init__(self, lanes: LaneTable, admission: Admission, delivery: Delivery, backend: Backend,
                 limits: planner.Limits, run_ahead: bool = True, drafting: Drafting | None = None) -> None:
        self._lanes, self._admission, self._delivery, self._backend = lanes, admission, delivery, backend
        self.limits, self._run_ahead, self._drafting = limits, run_ahead, drafting
        self._feeds = backend.shape.feeds  # the device can queue a decode pass fed by the draws of the one before
        self._cached = admission.caches
        self._step = 0
        self._planned_ahead = 0  # passes planned ahead since the drafter was last asked
        self.closing = False  # set by `close`: admit nothing new, end once the lanes are empty
        self._wake = trio.Event()  # set by the lane core's mailbox and timers: something to look at
        self.passes = self.prefill_rows = self.decode_rows = 0

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self.closing = True

    async def run(self) -> BackendFailed | None:
        """Passes until the lane core closes and its lanes are empty; a failed pass fails every waiter."""
        flight: InFlight | None = None
        back = None  # when the newest pass's result came back, if passes have run back to back since
        while True:
            if flight is None:
                self.boundary()
                if self.closing and not any(self._lanes.slots) and not self._admission.queue and not self._admission.warm:
                    return None
                by_lane = {job.lane: job for job in self._lanes.jobs()}
                drafting = self._drafting
                if drafting is not None:
                    await drafting.begin([j for j in by_lane.values() if j.phase is Phase.DECODE and j.live])
                plan = planner.plan(self._step, by_lane, self.limits, drafter=drafting)
                if not plan.work:
                    back = None
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                self._step += 1
                self._planned_ahead = 0  # planned afresh: the asks' count starts again
                queued = self._fed(((plan, None),), by_lane)
                try:
                    flight = InFlight(plan, by_lane, await self._run(plan, following=queued), queued)
                except Exception as error:
                    return self._failed(error)
                back = self._timed(plan, back, ahead=False)
            plan, by_lane, result, following = flight.plan, flight.by_lane, flight.result, flight.queued
            flight = None
            if following is None and plan.ahead and self._steady() and self._ahead_allowed(plan, result, by_lane):
                following = self._planned(planner.plan(self._step, by_lane, self.limits, after=((plan, result),)))
            if following is None:
                self._settle(plan, result, by_lane)
                continue
            behind = self._fed(((plan, result), (following, None)), by_lane)
            settle = _Settle(self, plan, result, by_lane)
            try:
                next_result = await self._run(following, settle, behind)
            except Exception as error:
                settle()  # the pass before has its result whatever became of this one
                settle.reraise()
                return self._failed(error)
            settle()
            settle.reraise()
            back = self._timed(following, back, ahead=True)
            flight = InFlight(following, by_lane, next_result, behind)

    async def _run(self, plan: Plan, started=None, following: Plan | None = None) -> PassResult:
        with trio.CancelScope(shield=True):  # the device writes KV into the plan's blocks until the pass ends
            return await self._backend.step(plan, started, following)

    def _timed(self, plan: Plan, back: float | None, ahead: bool) -> float:
        """The drafter's cost models learn a decode pass's time from the result before it to its own."""
        now = time.perf_counter()
        # decode passes alone teach them: a prompt's hundreds of cheaper rows would set the slope
        if self._drafting is not None and back is not None and not plan.prefills:
            self._drafting.passed(plan.rows, now - back, ahead)
        return now

    def _ahead_allowed(self, plan: Plan, result: PassResult, by_lane: dict[int, Job]) -> bool:
        """With a drafter, the next pass is planned ahead unless a fresh plan would draft, asked after a
        drafted pass and as often as the drafter's `asks_every` otherwise (a fresh plan costs the device a
        wait for the host; an ask costs the host its time)."""
        drafting = self._drafting
        if drafting is None:
            return True
        self._planned_ahead += 1
        if not (plan.drafted or self._planned_ahead >= drafting.asks_every()):
            return True
        self._planned_ahead = 0
        return not self._would_draft(((plan, result),), by_lane)

    def _would_draft(self, after, by_lane: dict[int, Job]) -> bool:
        """The drafter asked with the tokens the passes in flight drew for each job (those whose result is in)."""
        drawn: dict[int, tuple[int, ...]] = {}
        for plan, result in after:
            if result is None:
                continue
            for work, sampled in zip(plan.work, result.sampled):
                if sampled is not None:
                    job_id = by_lane[work.piece.lane].id
                    drawn[job_id] = drawn.get(job_id, ()) + sampled.tokens
        jobs = [j for j in by_lane.values() if j.phase is Phase.DECODE and j.live]
        return self._drafting.would_draft(jobs, drawn)

    def _planned(self, plan: Plan) -> Plan | None:
        if not plan.work:
            return None
        self._step += 1
        return plan

    def _fed(self, after, by_lane: dict[int, Job]) -> Plan | None:
        """The pass to queue behind `after`'s newest on a device that feeds it that pass's draws. A drafter is
        not asked here: on the H200 a chain of fed passes broken on the draws known (one pass short) cost more
        than the drafts won (bench/RESULTS.md), so it is asked where passes are planned ahead unfed."""
        newest = after[-1][0]
        if not (self._feeds and newest.feedable and self._steady()):
            return None
        if self._drafting is not None and not self._drafting.control:
            return None  # fixed draft lengths (tests, the fuzzer): every pass asks, as every lane drafts its most
        return self._planned(planner.plan(self._step, by_lane, self.limits, after=after))

    def _steady(self) -> bool:
        """Only decoding streams and nothing waiting: the next pass can be planned before this one is applied."""
        admission = self._admission
        return self._run_ahead and not (self.closing or admission.queue or admission.warm or admission.decider.busy
                                        or self._prefilling())

    def _prefilling(self) -> bool:
        prefill = Phase.PREFILL
        for job in self._lanes.slots:  # a plain loop: this runs every pass, over every lane
            if job is not None and job.phase is prefill:
                return True
        return False

    def _failed(self, error: Exception) -> BackendFailed:
        failure = BackendFailed(error)
        failure.__cause__ = error
        self.fail_all(failure)
        return failure

    # ---- between passes ----

    def _settle(self, plan: Plan, result: PassResult, by_lane: dict[int, Job]) -> None:
        self.passes += 1
        self.prefill_rows += plan.prefill_rows
        self.decode_rows += plan.decode_rows
        events = self._lanes.apply(plan, result, by_lane)
        if plan.drafted:
            for work, sampled in zip(plan.work, result.sampled):
                if work.draft:
                    self._drafting.observe(by_lane[work.piece.lane], len(work.draft), len(sampled.tokens) - 1)
        admission = self._admission
        for job in by_lane.values() if self._cached else ():  # only the prompt cache restores
            if job.done > job.cached and admission.restoring(job):
                admission.report_restore(job)  # its first pass over the restored prefix is done
        send = self._delivery.send
        for job, event in events:
            send(job, event)

    def boundary(self) -> None:
        """Offer run prompts to the prompt cache, free the lanes of jobs that ended, then admit what waits."""
        decode, uncached = Phase.DECODE, not self._cached
        for lane, job in enumerate(self._lanes.slots):
            if job is None or (job.phase is decode and not job.cancelled and job.outcome is None
                               and (uncached or job.kept)):
                continue  # free, or a stream under way whose prompt is kept: most lanes, every pass
            if not uncached and job.kind == "stream" and not job.kept and job.done >= len(job.prompt):
                self._admission.keep_prompt(job)
            # A decoding stream is sent an event every pass, which finds a closed consumer; others are asked.
            if (job.phase is not decode or job.paused) and job.outcome is None and self._delivery.consumer_gone(job):
                self._lanes.cancel(job)
            if job.cancelled or job.outcome is not None:
                self._free(lane, job)
        self._admission.admit()

    def _free(self, lane: int, job: Job) -> None:
        admission = self._admission
        if admission.restoring(job):
            admission.report_restore(job)
        if job.kind == "warm":
            admission.finish_warm(job)
        elif job.kind in ("trunk", "branch"):
            admission.decider.unbound(job)
        elif job.outcome is None:
            self._delivery.answer(job, Finished("cancelled", prompt_tokens=len(job.prompt),
                                                completion_tokens=len(job.generated), cached_tokens=job.cached))
        if job.kind == "stream" and self._drafting is not None:
            self._drafting.ended(job)
        self._lanes.unbind(lane)
        admission.forget(job)

    def fail_all(self, error: EngineError) -> None:
        """Every waiter and every job in a lane gets `error`, and every lane is freed."""
        self._admission.fail_waiting(error)
        for lane, job in enumerate(self._lanes.slots):
            if job is not None:
                if job.kind == "warm":
                    self._lanes.cancel(job)
                else:
                    self._delivery.answer(job, Failed(error))
                self._free(lane, job)


class _Settle:
    """A pass's settling as the `started` callback of the pass after it: run once, in the event loop (in
    the stepping task, or as a trio callback when a worker thread launches). A callback must not raise,
    so an error is kept for the pass loop to raise in its own task."""

    __slots__ = ("loop", "plan", "result", "by_lane", "ran", "error")

    def __init__(self, loop: PassLoop, plan: Plan, result: PassResult, by_lane: dict[int, Job]) -> None:
        self.loop, self.plan, self.result, self.by_lane = loop, plan, result, by_lane
        self.ran, self.error = False, None

    def __call__(self) -> None:
        if self.ran:
            return
        self.ran = True
        try:
            self.loop._settle(self.plan, self.result, self.by_lane)
            self.loop.boundary()  # lanes of ended streams free now; admitted work is planned after the pass ahead
        except BaseException as error:  # raised again by `reraise`, in the pass loop's task
            self.error = error

    def reraise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
