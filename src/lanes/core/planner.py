"""The planner: the lane core's next pass as a frozen `Plan`, a plain function over plain data.

One function, `plan`, for every pass. With nothing in flight it plans from the jobs' own state: prompt
chunks of up to 16 prefilling lanes within `max_rows` prompt rows, then one decode row a live stream (with
its drafter's proposal after it, when there is one). Given the passes in flight whose results are not
applied (`after`: oldest first, the newest with its result when the step has returned, else being run),
it plans each stream's decode row again one position on: fed the token the newest pass drew, or, when
that is still on the device, a stand-in the device reads from its draws (a `fed` plan).

The planner also decides, once, what each plan allows (`Plan.plain`, `Plan.ahead`; docs/DECISIONS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from .job import Job, Phase
from .passes import Piece
from .plan import PassResult, Plan, Work
from .sampling import RowSampling

MAX_PREFILLS = 16
FED = 0  # a fed row's stand-in token
_UNKNOWN = object()  # a lane that an older pass in flight had no row for


class Drafter(Protocol):
    def plan(self, jobs: Sequence[Job]) -> dict[int, int]:
        """Each decoding job's draft length for the next pass, by job id."""
        ...

    def propose(self, job: Job, most: int) -> tuple[int, ...]:
        """Up to `most` tokens that may follow `job.pending` (none: the row goes undrafted)."""
        ...


@dataclass(frozen=True)
class Limits:
    max_rows: int  # prompt rows a pass may carry (decode rows come on top, one a live lane)
    max_prefills: int = MAX_PREFILLS


def plan(step: int, jobs: Mapping[int, Job], limits: Limits, after: Sequence[tuple[Plan, PassResult | None]] = (),
         drafter: Drafter | None = None) -> Plan:
    """The next pass for `jobs` (by lane, in admission order); see the module's docstring for `after`."""
    if after:
        return _after(step, jobs, after)
    prefill: list[Work] = []
    decode: list[Work] = []
    budget = limits.max_rows
    plain = ahead = True
    drafted = 0
    lengths = drafter.plan([j for j in jobs.values() if j.phase is Phase.DECODE and j.live]) if drafter else None
    for job in jobs.values():
        if not job.live:
            continue
        if job.phase is Phase.DECODE:
            if job.paused:
                continue
            params = job.sampling
            generated = len(job.generated)
            ahead = ahead and (params.plain or not params.needs_penalties)  # a plain draw reads no penalty
            ahead = ahead and params.grammar is None  # its mask needs the matcher advanced by this pass
            most = min(lengths.get(job.id, 0), job.max_new - generated - 1) if lengths is not None else 0
            draft = drafter.propose(job, most) if most > 0 else ()
            if draft:
                piece = Piece(job.lane, (job.pending, *draft), job.done, tuple(job.table.blocks), "all")
                drafted += len(draft)
                plain = False
                decode.append(Work(piece, RowSampling(job.lane, params, generated), (), 0, (), draft))
                continue
            plain = plain and params.plain
            decode.append(Work(Piece(job.lane, (job.pending,), job.done, tuple(job.table.blocks)),
                               RowSampling(job.lane, params, generated)))
        elif len(prefill) < limits.max_prefills and budget > 0:  # prefilling lanes past the limits wait
            take = min(len(job.prompt) - job.done, budget)
            budget -= take
            work = _prompt_work(job, take)
            plain = plain and work.sample is not None and work.sample.params.plain and not work.targets
            prefill.append(work)
    # Whether the pass after is planned ahead (carrying no draft) or afresh is the pass loop's to ask the drafter.
    return Plan(step=step, work=tuple(prefill + decode), prefills=len(prefill), plain=plain,
                ahead=ahead and not prefill, drafted=drafted)


def _after(step: int, jobs: Mapping[int, Job], after: Sequence[tuple[Plan, PassResult | None]]) -> Plan:
    """Each stream's decode row after the passes in flight (at most two: one with its result, and the newest,
    which may still be on the device). A stream those passes end (a stop token, its length) gets no row;
    one that turns out to have ended anyway (a stop string, a cancel) runs one void row: its KV lands past
    its end, in blocks nobody reuses before the pass is over, and the lane table gives it no event."""
    newest, result = after[-1]
    older = after[0] if len(after) > 1 else None
    drawn = {w.piece.lane: s for w, s in zip(older[0].work, older[1].sampled, strict=True)} if older else None
    work = []
    plain = True  # of the rows kept: a stream whose draw needs the host's sampler may have just ended
    for i, w in enumerate(newest.work):  # a plain loop, by index: this runs every pass, over every lane
        piece = w.piece
        lane = piece.lane
        job = jobs[lane]
        if job.cancelled or job.outcome is not None or job.paused:
            continue
        stops = job.stops
        taken = len(job.generated)  # tokens out once the passes in flight are applied
        if drawn is not None:
            known = drawn.get(lane, _UNKNOWN)
            if known is not _UNKNOWN:
                if known is None or _ends(known.tokens, stops):
                    continue  # the older pass ended it
                taken += len(known.tokens)
        if result is None:  # the newest is still on the device: a fed row is one token, its draw read there
            token, start = FED, piece.start + 1
            taken += 1
        else:
            drew = result.sampled[i].tokens
            if _ends(drew, stops):
                continue
            token, start = drew[-1], piece.start + len(drew)
            taken += len(drew)
        if taken >= job.max_new:
            continue
        plain = plain and job.sampling.plain
        work.append(Work(Piece(lane, (token,), start, piece.blocks), RowSampling(lane, job.sampling, taken)))
    fed = result is None
    return Plan(step, tuple(work), 0, fed=fed, plain=plain, ahead=True)


def _ends(tokens: tuple[int, ...], stops: frozenset[int]) -> bool:
    """Whether a stop token is among a pass's tokens for a lane (one, mostly)."""
    if len(tokens) == 1:
        return tokens[0] in stops
    return not stops.isdisjoint(tokens)


def _prompt_work(job: Job, take: int) -> Work:
    start, end = job.done, job.done + take
    final = end == len(job.prompt)
    sample = RowSampling(job.lane, job.sampling, 0) if final and job.kind == "stream" and job.max_new else None
    labels = job.labels if final and job.kind == "branch" else ()
    wants_logprobs = job.sampling.prompt_logprobs and job.kind == "stream"
    logits = "all" if wants_logprobs else ("last" if sample or labels else "none")
    targets = job.prompt[start + 1 : end + 1] if wants_logprobs else ()
    piece = Piece(job.lane, job.prompt[start:end], start, tuple(job.table.blocks), logits)
    return Work(piece, sample=sample, targets=targets, top=job.sampling.top_logprobs if wants_logprobs else 0,
                labels=labels)
