"""The lane table: the lanes and the jobs in them, and the one writer of a job's lane state (job.py lists
it): it binds a job to a lane with its blocks, advances it by each pass's result, ends it, and frees it.

Synchronous state on the Trio thread, like the block pool: every method runs between checkpoints.
"""

from __future__ import annotations

from typing import Sequence

from .backend import Backend
from .blocks import BlockPool, BlockTable, IntegrityError
from .job import Job, Phase
from .plan import PassResult, Plan, Sampled
from .stream import Failed, Finished, PromptLogprobs, StreamEvent, TokenEvent, TopLogprob

Events = list[tuple[Job, StreamEvent]]


class LaneTable:
    """`slots[lane]` is the job in that lane (read by anyone in the lane core; written only here)."""

    def __init__(self, count: int, pool: BlockPool, backend: Backend) -> None:
        self.slots: list[Job | None] = [None] * count
        self._pool, self._backend = pool, backend
        self.finished = 0  # streams that ended by themselves (a stop or their length)
        self.ended = 0  # streams ended from outside (cancelled, failed, their client gone)

    # ---- binding and freeing ----

    def free(self) -> list[int]:
        return [lane for lane, job in enumerate(self.slots) if job is None]

    def jobs(self) -> list[Job]:
        """The jobs in lanes, in admission order (their ids)."""
        return sorted((job for job in self.slots if job is not None), key=lambda job: job.id)

    def bind(self, job: Job, lane: int, capacity: int, adopt: tuple[Sequence[int], int] = ((), 0),
             phase: Phase = Phase.PREFILL) -> None:
        """`job` takes `lane`: its table adopts `adopt`'s blocks, which hold its first tokens, and reserves
        room for `capacity` tokens; streams (and jobs with media) bind the backend's lane state."""
        if self.slots[lane] is not None:
            raise IntegrityError(f"lane {lane} is taken by job {self.slots[lane].id}")
        if job.outcome is not None or job.cancelled:
            raise IntegrityError(f"job {job.id} takes a lane after its end")
        job.lane = lane
        job.table = BlockTable(("lane", lane))
        self.slots[lane] = job
        self._phase(job, phase)
        if job.kind == "stream" or job.media:  # a decision's prefill with images needs their positions and tower
            self._backend.bind(lane, job.prompt, job.sampling, job.media)
        blocks, tokens = adopt
        if blocks:
            job.table.adopt(self._pool, blocks, tokens)
        self._fill(job, tokens)
        job.table.reserve(self._pool, capacity)

    def unbind(self, lane: int) -> Job:
        """Free `lane` (its job has ended or was cancelled): its blocks go back and its device state goes."""
        job = self.slots[lane]
        if job.kind == "stream" or job.media:  # exactly the jobs `bind` bound
            self._backend.unbind(lane)
        if job.kind == "stream":
            if isinstance(job.outcome, Finished) and job.outcome.reason != "cancelled":
                self.finished += 1
            else:
                self.ended += 1
        job.table.clear(self._pool)
        self.slots[lane] = None
        self._phase(job, Phase.DONE)
        return job

    # ---- a job's end, from outside its passes ----

    def cancel(self, job: Job) -> None:
        """No more rows for `job`; its lane (if any) is freed at the next boundary."""
        job.cancelled = True

    def end(self, job: Job, outcome: Finished | Failed) -> bool:
        """Give `job` its outcome, once; whether this was it (the caller then delivers it)."""
        if job.outcome is not None:
            return False
        self._end(job, outcome)
        return True

    def pause(self, job: Job, paused: bool) -> None:
        """A stream whose consumer is `stream_buffer` events behind gets no rows until it has read."""
        job.paused = paused

    # ---- a pass's result ----

    def apply(self, plan: Plan, result: PassResult, by_lane: dict[int, Job]) -> Events:
        """Advance every job the plan carried by the pass's result; the events to deliver, in order.

        A job cancelled or finished while the pass ran is advanced (its KV was written) but gets no events."""
        events: Events = []
        reads = result.reads or (None,) * len(plan.work)
        for work, sampled, logprobs, read in zip(plan.work, result.sampled, result.prompt_logprobs, reads, strict=True):
            piece = work.piece
            job = by_lane[piece.lane]
            if piece.start != job.done:
                raise AssertionError(f"job {job.id}: a pass wrote from {piece.start}, the job had {job.done}")
            # a drafted piece's rows past its accepted tokens are void: the next pass writes over them
            self._fill(job, piece.start + len(sampled.tokens) if work.draft else piece.end)
            if job.phase is Phase.PREFILL and job.done == len(job.prompt):
                self._phase(job, Phase.DECODE if job.kind == "stream" else Phase.DONE)
                if job.kind != "stream":  # a warm pass, a trunk or a branch ends with its prompt
                    job.read = read
                    self._end(job, Finished("stop", prompt_tokens=len(job.prompt)))
            if job.cancelled or job.outcome is not None:
                continue
            # a stream that draws nothing (max_tokens 0) ends with its prompt: its logprobs, then the end
            drawless = sampled is None and job.max_new == 0 and job.kind == "stream" and job.done == len(job.prompt)
            if logprobs is not None:
                job.prompt_logprobs.append(logprobs)
                if sampled is not None or drawless:
                    events.append((job, _prompt_logprobs_event(job)))
            if sampled is not None:
                tokens = sampled.tokens
                if len(tokens) == 1:  # one token a lane a pass (undrafted): no loop
                    self._take_one(job, tokens[0], sampled.logprobs[0], sampled.top[0], events)
                else:
                    self._take(job, sampled, events)
            elif drawless:
                events.append((job, self._finish(job, "length", "")))
        return events

    def _take(self, job: Job, sampled: Sampled, events: Events) -> None:
        """Give `job` its drawn tokens in turn, until one of them ends it (the rest are dropped)."""
        for token, logprob, top in zip(sampled.tokens, sampled.logprobs, sampled.top):
            if self._take_one(job, token, logprob, top, events):
                return

    def _take_one(self, job: Job, token: int, logprob: float | None, top_pairs: tuple, events: Events) -> bool:
        """Give `job` one drawn token, appending its event and the end that it, a stop string or the stream's
        length makes; whether it ended the stream. Up to min_tokens tokens out, no stop token ends it (as
        vLLM, which masks them; the text assembler holds stop strings off as long)."""
        generated, text = job.generated, job.text
        generated.append(token)
        job.pending = token
        top = tuple(TopLogprob(t, lp) for t, lp in top_pairs) if top_pairs else ()
        if token in job.stops and len(generated) > job.sampling.min_tokens:
            if job.sampling.include_stop_str_in_output:  # its text too (cut where it completes a stop string)
                piece, _ = text.push(token)
                events.append((job, TokenEvent(token, piece + text.finish(), logprob, top)))
                events.append((job, self._finish(job, "stop", "")))
                return True
            # A stop token ends the stream and contributes no text, as OpenAI's servers do.
            events.append((job, TokenEvent(token, "", logprob, top)))
            events.append((job, self._finish(job, "stop", text.finish())))
            return True
        piece, stopped = text.push(token)
        events.append((job, TokenEvent(token, piece, logprob, top)))
        if stopped:
            events.append((job, self._finish(job, "stop", "")))
            return True
        if len(generated) >= job.max_new:
            events.append((job, self._finish(job, "length", text.finish())))
            return True
        return False

    def _finish(self, job: Job, reason: str, text: str) -> Finished:
        outcome = Finished(reason, text, prompt_tokens=len(job.prompt), completion_tokens=len(job.generated),
                           cached_tokens=job.cached)
        self._end(job, outcome)
        return outcome

    # ---- the one assignment of each field written in more than one step ----

    @staticmethod
    def _phase(job: Job, phase: Phase) -> None:
        job.phase = phase

    @staticmethod
    def _end(job: Job, outcome: Finished | Failed) -> None:
        job.outcome = outcome

    @staticmethod
    def _fill(job: Job, end: int) -> None:
        job.done = end  # the lane's KV holds the context up to here


def _prompt_logprobs_event(job: Job) -> PromptLogprobs:
    logprobs: list[float | None] = [None]
    top: list[tuple[TopLogprob, ...]] = [()]
    for part in job.prompt_logprobs:
        logprobs.extend(part.logprobs)
        top.extend(tuple(TopLogprob(t, lp) for t, lp in row) for row in part.top)
    return PromptLogprobs(tuple(logprobs), tuple(top))
