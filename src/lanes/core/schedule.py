"""Plan and apply: the lane core's pass logic as plain functions over plain data (no I/O, no awaits).

`plan` turns the jobs in lanes into a frozen `Plan`: one decode row for every live lane, and prompt chunks
of up to 16 prefilling lanes within `max_rows` prompt rows. `apply` consumes the pass's result: it
advances each job, draws its text, decides whether it finished, and returns the events to deliver.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Literal, Sequence

from .blocks import BlockTable
from .media import cache_key
from .passes import Piece
from .plan import PassResult, Plan, Sampled, Work
from .sampling import RowSampling, SamplingParams, plain_greedy
from .stream import Failed, Finished, PromptLogprobs, StreamEvent, TokenEvent, TopLogprob

MAX_PREFILLS = 16
_UNKNOWN = object()  # a lane that the known pass had no row for
_FED = (0,)  # a fed row's stand-in token


class Phase(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


JobKind = Literal["stream", "warm", "trunk", "branch"]  # trunk and branch: a decision's prefills


@dataclass(eq=False)
class Job:
    """A stream (or a warm pass) as the lane core tracks it; owned by the lane core alone."""

    id: int
    kind: JobKind
    prompt: tuple[int, ...]
    sampling: SamplingParams
    limit: int  # most tokens of context: the prompt and every token it may generate
    deadline: float = float("inf")
    phase: Phase = Phase.QUEUED
    lane: int | None = None
    table: BlockTable | None = None
    done: int = 0  # context tokens whose KV is in the lane's blocks
    generated: list[int] = field(default_factory=list)
    pending: int | None = None  # the last drawn token, fed to the next decode row
    cancelled: bool = False
    outcome: Finished | Failed | None = None
    text: object = None  # a TextAssembler: push(token) -> (text, stopped), finish() -> text
    prompt_logprobs: list = field(default_factory=list)
    cached: int = 0  # prompt tokens restored from the prompt cache
    restore: object = None  # the cache node being restored, until its restore reports
    kept: bool = False  # the prompt's full blocks have been offered to the prompt cache
    labels: tuple[int, ...] = ()  # a branch's label tokens, read at the row after its prompt
    read: object = None  # a branch's LabelRead, once its last row has run
    owner: object = None  # the DecisionJob a trunk or branch belongs to
    into_cache: bool = False  # a warm pass whose blocks go to the prompt cache, not to its asker
    stops: frozenset[int] | None = None  # the tokens that end it, worked out at its first draw
    media: tuple = ()  # PromptMedia in the prompt, handed to the backend when the job takes a lane
    key: tuple = ()  # the prompt as the prompt cache keys it: its tokens, media rows by their digests
    looked_up: object = None  # its prompt cache lookup, counted once it is placed
    paused: bool = False  # its consumer is far behind: no decode rows until it has read (lane kept)

    def __post_init__(self) -> None:
        self.key = cache_key(self.prompt, self.media)
        self.max_new = self.limit - len(self.prompt)  # read for every row of every pass

    @property
    def capacity(self) -> int:
        """KV slots its lane holds: every context token but the last drawn (never fed back), or the whole
        prompt when it draws nothing (max_tokens 0)."""
        return self.limit - 1 if self.max_new else self.limit

    def stop_tokens(self, stop_ids: frozenset[int]) -> frozenset[int]:
        if self.stops is None:
            own = frozenset(self.sampling.stop_token_ids)
            self.stops = own if self.sampling.ignore_eos else own | stop_ids
        return self.stops

    @property
    def live(self) -> bool:
        """In a lane, wanted, and not finished: it gets rows in the next pass."""
        return self.phase in (Phase.PREFILL, Phase.DECODE) and not self.cancelled and self.outcome is None


@dataclass(frozen=True)
class Limits:
    max_rows: int  # prompt rows a pass may carry (decode rows come on top, one a live lane)
    max_prefills: int = MAX_PREFILLS


def plan(step: int, jobs: Sequence[Job], limits: Limits) -> Plan:
    """The next pass for `jobs` (in admission order): prompt chunks first, then one decode row a live lane."""
    prefill: list[Work] = []
    decode: list[Work] = []
    budget = limits.max_rows
    for job in jobs:
        if not job.live:
            continue
        if job.phase is Phase.DECODE:
            if job.paused:
                continue
            piece = Piece(job.lane, (job.pending,), job.done, tuple(job.table.blocks))
            decode.append(Work(piece, RowSampling(job.lane, job.sampling, len(job.generated))))
        elif len(prefill) < limits.max_prefills and budget > 0:  # prefilling lanes past the limits wait
            take = min(len(job.prompt) - job.done, budget)
            budget -= take
            prefill.append(_prompt_work(job, take))
    return Plan(step=step, work=tuple(prefill + decode), prefills=len(prefill))


def lookahead(step: int, plan: Plan, result: PassResult, jobs_by_lane: dict[int, Job], stop_ids: Iterable[int]) -> Plan | None:
    """The pass after `plan`, built from its result before that is applied: each stream's decode row again,
    one position on, fed the token just drawn. None unless `plan` is only streams' plain decode rows.

    Streams that the drawn token ends (a stop token, the length) get no row. A row whose stream turns out
    to have ended anyway (a stop string, a cancel) runs void: its KV lands past the stream's end, in blocks
    nobody reuses before this pass is over, and `apply` gives it no event.
    """
    if plan.prefills:
        return None
    stop_ids = frozenset(stop_ids)
    work = []
    for w, sampled in zip(plan.work, result.sampled, strict=True):
        job = jobs_by_lane[w.piece.lane]
        if job.kind != "stream" or sampled is None or w.targets or w.labels or job.sampling.needs_penalties:
            return None  # penalties would have the device state of a lane touched while it changes hands
        if job.cancelled or job.outcome is not None or job.paused:
            continue
        if sampled.token in job.stop_tokens(stop_ids) or len(job.generated) + 1 >= job.max_new:
            continue
        piece = Piece(job.lane, (sampled.token,), w.piece.end, w.piece.blocks)
        work.append(Work(piece, RowSampling(job.lane, job.sampling, len(job.generated) + 1)))
    return Plan(step, tuple(work), 0) if work else None


def fed_after(step: int, plan: Plan, jobs_by_lane: dict[int, Job], stop_ids: Iterable[int], unapplied: int,
              known: tuple[Plan, PassResult] | None = None) -> Plan | None:
    """The pass after `plan`, built before `plan` has run: each stream's decode row again, one position on,
    its token read on the device from `plan`'s draw (a `fed` plan). None unless every row of `plan` is a
    stream's plain greedy decode row.

    `unapplied`: the passes whose tokens no job has taken yet, `plan` included (1, or 2 when the pass
    before `plan` has a result, `known`, that is not applied either). Streams that `known` ends, or that
    reach their length within those passes, get no row; one that `plan` itself ends runs void (`lookahead`).
    """
    if plan.prefills or not plan.work:
        return None
    if not plan.fed and (any(jobs_by_lane[w.piece.lane].kind != "stream" or w.sample is None or w.targets or w.labels
                             for w in plan.work) or not plain_greedy([w.sample for w in plan.work])):
        return None  # (a fed plan's rows were all checked when the first of its chain was built)
    stop_ids = frozenset(stop_ids)
    drawn = {w.piece.lane: s for w, s in zip(known[0].work, known[1].sampled, strict=True)} if known else {}
    work = []
    for w in plan.work:
        piece = w.piece
        lane = piece.lane
        job = jobs_by_lane[lane]
        if job.cancelled or job.outcome is not None or job.paused:
            continue
        sampled = drawn.get(lane, _UNKNOWN)
        if sampled is not _UNKNOWN and (sampled is None or sampled.token in job.stop_tokens(stop_ids)):
            continue  # `known` ended it
        row_step = len(job.generated) + unapplied
        if row_step >= job.max_new:
            continue
        # A decode row is one token, so the next starts one on; its token is read on the device.
        work.append(Work(Piece(lane, _FED, piece.start + 1, piece.blocks), RowSampling(lane, job.sampling, row_step)))
    return Plan(step, tuple(work), 0, fed=True) if work else None


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


def apply(plan: Plan, result: PassResult, jobs_by_lane: dict[int, Job], stop_ids: Iterable[int]) -> list[tuple[Job, StreamEvent]]:
    """Advance every job the plan carried; return the events to deliver, in order.

    A job cancelled or finished while the pass ran is advanced (its KV was written) but gets no events.
    """
    stop_ids = frozenset(stop_ids)
    events: list[tuple[Job, StreamEvent]] = []
    reads = result.reads or (None,) * len(plan.work)
    for work, sampled, logprobs, read in zip(plan.work, result.sampled, result.prompt_logprobs, reads, strict=True):
        piece = work.piece
        job = jobs_by_lane[piece.lane]
        if piece.start != job.done:
            raise AssertionError(f"job {job.id}: a pass wrote from {piece.start}, the job had {job.done}")
        job.done = piece.end
        if job.phase is Phase.PREFILL and job.done == len(job.prompt):
            job.phase = Phase.DECODE if job.kind == "stream" else Phase.DONE
            if job.kind != "stream":  # a warm pass, a trunk or a branch ends with its prompt
                job.read = read
                job.outcome = Finished("stop", prompt_tokens=len(job.prompt))
        if job.cancelled or job.outcome is not None:
            continue
        # A stream that draws nothing (max_tokens 0) ends with its prompt: its logprobs, then the end.
        drawless = sampled is None and job.max_new == 0 and job.kind == "stream" and job.done == len(job.prompt)
        if logprobs is not None:
            job.prompt_logprobs.append(logprobs)
            if sampled is not None or drawless:
                events.append((job, _prompt_logprobs_event(job)))
        if sampled is not None:
            _take(job, sampled, stop_ids, events)
        elif drawless:
            events.append((job, _finish(job, "length", "")))
    return events


def take_first(job: Job, token: int, stop_ids: Iterable[int]) -> list[StreamEvent]:
    """The first token of a stream a driver prefilled and sampled itself (adopt_prefilled)."""
    events: list[tuple[Job, StreamEvent]] = []
    _take(job, Sampled(token), frozenset(stop_ids), events)
    return [event for _, event in events]


def _take(job: Job, sampled: Sampled, stop_ids: frozenset[int], events: list[tuple[Job, StreamEvent]]) -> None:
    """Give `job` its drawn token, appending its events: the token's, and the end that it, a stop string
    or the stream's length makes. Up to min_tokens tokens out, no stop token ends it (as vLLM, which
    masks them; the text assembler holds stop strings off as long)."""
    token = sampled.token
    generated = job.generated
    generated.append(token)
    job.pending = token
    top = tuple(TopLogprob(t, lp) for t, lp in sampled.top) if sampled.top else ()
    if token in job.stop_tokens(stop_ids) and len(generated) > job.sampling.min_tokens:
        if job.sampling.include_stop_str_in_output:  # its text too (cut where it completes a stop string)
            text, _ = job.text.push(token)
            events.append((job, TokenEvent(token, text + job.text.finish(), sampled.logprob, top)))
            events.append((job, _finish(job, "stop", "")))
            return
        # A stop token ends the stream and contributes no text, as OpenAI's servers do.
        events.append((job, TokenEvent(token, "", sampled.logprob, top)))
        events.append((job, _finish(job, "stop", job.text.finish())))
        return
    text, stopped = job.text.push(token)
    events.append((job, TokenEvent(token, text, sampled.logprob, top)))
    if stopped:
        events.append((job, _finish(job, "stop", "")))
    elif len(generated) >= job.max_new:
        events.append((job, _finish(job, "length", job.text.finish())))


def _finish(job: Job, reason: str, text: str) -> Finished:
    job.outcome = Finished(reason, text, prompt_tokens=len(job.prompt), completion_tokens=len(job.generated),
                           cached_tokens=job.cached)
    return job.outcome


def _prompt_logprobs_event(job: Job) -> PromptLogprobs:
    logprobs: list[float | None] = [None]
    top: list[tuple[TopLogprob, ...]] = [()]
    for part in job.prompt_logprobs:
        logprobs.extend(part.logprobs)
        top.extend(tuple(TopLogprob(t, lp) for t, lp in row) for row in part.top)
    return PromptLogprobs(tuple(logprobs), tuple(top))
