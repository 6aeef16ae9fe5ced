"""Drafting: how many tokens each lane drafts, and asking its source for them.

The one owner of each stream's draft record (its draft tokens kept and tried, decayed) and of two models
of the decode passes' cost (`pass_cost`: a line with a knee, rows under it free, learnt from the passes
themselves, each timed from the result of the pass before): passes planned afresh after that result, as a
drafted pass must be, and passes planned ahead of it (or fed behind it on the device), whose host work
hides under the device's. Before a pass it gives each lane the draft length that most raises the pass's expected
tokens a second: a lane whose first draft token is kept with chance a, and each later one with chance b
given the ones before it were, gains a b^k expected tokens from its (k+1)-th draft token, which costs one
row; a lane drafts one more token while that gain beats the pass's current tokens a second times a row's
cost (nothing under the knee). The two chances differ: a draft that starts right goes on right (a copy of the prompt, measured:
its first token kept 0.68 of the time, each later one 0.91-0.98), so one chance for all undervalues the
tail of a long draft. A source may tell its drafts' kinds apart (`Draft.kind`: prompt lookup's n-gram
length, whose 4-grams held 0.98 of the time where its 2-grams held 0.46): each kind has its own records. A
stream's record starts as every stream's lately (each draft's fate, decayed over
some twenty), not a fixed prior: the first drafts of a copy are long where copies are what is asked for.
Then the drafted pass must beat a plain pass planned ahead, at its rate, by MARGIN, or nothing
is drafted: on a GPU a pass planned ahead costs a fraction of one planned afresh, and a prediction a few
percent better lost 4-9% at 8 streams on a 2-core CPU. So a lane whose drafts fail, or a pass big enough that rows are
dear, drafts nothing. A lane's gains are also weighed by how often its source found a draft when asked:
a dry ask costs no row, but its pass could not be planned ahead.

A source that can `peek` (its draft once the tokens drawn but not yet applied follow the context) is asked
before a fresh pass is chosen over one planned ahead: lanes whose source would find nothing draft nothing,
so no fresh pass is spent on a dry ask, and every lane's would-be draft is kept and scored against the
tokens the lane then draws: its acceptance is learnt while it does not draft (a drafted token is kept
exactly when it equals the lane's own draw), so probing for rates is not needed and probes back off.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from .job import Job
from .pass_cost import PassCost

PRIOR = 0.6  # the acceptance the first streams' first drafts are planned with
PRIOR_TRIALS = 2.0  # a prior's weight in draft tokens tried, decayed like a stream's own
RECORD_PRIOR = (PRIOR * PRIOR_TRIALS, PRIOR_TRIALS) * 2  # the first shared record: (kept, tried) first tokens, later ones
DECAY = 0.8  # the weight of a stream's past drafts against its latest one
SHARED_DECAY = 0.95  # the weight of past drafts, every stream's, in the record a new stream starts from
FOUND_PRIOR = (1.0, 1.0)  # a stream's source is first taken to find a draft whenever asked (found, asked)
EXPLORE = 256  # a decision drafts nothing, so plain passes are planned ahead and timed, once this many lack one
PROBE = 16  # the 16th decision in a row that drafts nothing drafts one token: the fresh cost stays learnt
MOST_PROBE = 1024  # each probe doubles the decisions to the next, up to this, until a decision drafts
ASK_SHARE = 0.05  # asking whether to draft may take this share of the passes planned ahead, at most
PEEKS = 16  # lanes peeked an ask at most, in turn: an ask's host time stays that of 16 lanes
MOST_ASK = 16  # passes planned ahead between asks, at most
MARGIN = 1.15  # a drafted pass must beat a plain one by this: its cost and rates are learnt from noisy passes


class Draft(tuple):
    """A source's draft tokens and its kind (prompt lookup: the n-gram's length), when the source can tell
    drafts apart by how likely they hold: load control keeps a record for each kind. A tuple elsewhere."""

    kind: Hashable = None

    def __new__(cls, tokens, kind: Hashable = None) -> "Draft":
        return super().__new__(cls, tokens)

    def __init__(self, tokens, kind: Hashable = None) -> None:
        self.kind = kind


Record = tuple[float, float, float, float]  # first, later draft tokens kept and tried, decayed


class DraftSource(Protocol):
    """Where drafts come from (`lanes.drafts`): n-grams of a stream's own context, a suffix index, a model."""

    def propose(self, job: Job, most: int) -> tuple[int, ...]:
        """Up to `most` tokens that may follow the stream's context (its prompt and generated tokens), a
        `Draft` where the source knows their kind."""
        ...

    def forget(self, job: Job) -> None:
        """The stream has ended: what is kept for it alone goes (what it taught a shared index stays)."""
        ...


class Peeking(Protocol):
    """A source that can say, changing nothing, what it would propose once `after` follows the context."""

    def peek(self, job: Job, after: Sequence[int], most: int) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class PassTimes:
    """Decode passes of one kind as load control timed them: how many, their seconds and rows in all."""

    passes: int = 0
    seconds: float = 0.0
    rows: int = 0

    def add(self, rows: int, seconds: float) -> "PassTimes":
        return PassTimes(self.passes + 1, self.seconds + seconds, self.rows + rows)

    def since(self, before: "PassTimes") -> "PassTimes":
        return PassTimes(self.passes - before.passes, self.seconds - before.seconds, self.rows - before.rows)

    def __str__(self) -> str:
        n = self.passes
        return f"{n} ({self.seconds / n * 1e3:.2f} ms, {self.rows / n:.0f} rows)" if n else "0"


@dataclass(frozen=True)
class DraftStats:
    drafted: int  # draft tokens proposed in passes
    accepted: int  # of those, kept
    pieces: int  # drafted pieces (a lane's draft in one pass)
    fresh: PassTimes = PassTimes()  # decode passes planned after their predecessor's result
    ahead: PassTimes = PassTimes()  # decode passes planned (or fed) ahead of it

    @property
    def mean_accepted(self) -> float:
        """Draft tokens kept a drafted piece."""
        return self.accepted / self.pieces if self.pieces else 0.0

    def since(self, before: "DraftStats") -> "DraftStats":
        """What happened after `before` was read."""
        return DraftStats(self.drafted - before.drafted, self.accepted - before.accepted, self.pieces - before.pieces,
                          self.fresh.since(before.fresh), self.ahead.since(before.ahead))


class Drafting:
    """The planner's drafter (`planner.Drafter`): `propose` for each decoding lane of a pass; the pass loop
    reports each pass's cost (`passed`) and its drafts' fate (`observe`), and each stream's end (`ended`);
    while passes are planned ahead it asks, now and then, whether a fresh plan would draft (`would_draft`)."""

    def __init__(self, source: DraftSource, most: int, control: bool = True) -> None:
        self.source, self.most = source, most
        self.control = control  # off: every lane drafts `most` (tests and the fuzzer, which run in virtual time)
        self._record: dict[int, dict[Hashable, Record]] = {}  # job id -> its drafts' record, by their kind
        self._shared: dict[Hashable, Record] = {}  # kind -> every stream's drafts of it: a stream's until it has its own
        self._kinds: dict[int, Hashable] = {}  # job id -> the kind of its latest draft
        self._found: dict[int, tuple[float, float]] = {}  # job id -> times its source found a draft and was asked
        self._lengths: dict[int, int] = {}  # job id -> its draft length in the pass being planned (`begin`)
        self._ready: dict[int, int] | None = None  # lengths `would_draft` chose, for the fresh plan it asked for
        self.fresh, self.ahead = PassCost(), PassCost()  # passes planned after their predecessor's result, and ahead of it
        self._idle = 0  # decisions in a row that drafted nothing
        self._probe_every = PROBE  # idle decisions from one probe to the next
        self._unseen = EXPLORE  # decisions since a pass planned ahead was timed (none yet: the first explores)
        self._peek = getattr(source, "peek", None)
        self._shadows: dict[int, tuple[int, tuple[int, ...]]] = {}  # job id -> where a would-be draft starts, the draft
        self._asked = 0.0  # seconds the latest `would_draft` took
        self._turn = 0  # where the next ask's lanes to peek begin, past PEEKS lanes
        self._lanes = 1  # decoding lanes at the latest decision
        self.drafted = self.accepted = self.pieces = 0
        self.times = {False: PassTimes(), True: PassTimes()}  # ahead -> the passes timed

    async def begin(self, jobs) -> None:
        """Before a pass is planned: each decoding job's draft length, and the source's drafts made ready
        where making them takes a model's passes (off the event loop)."""
        if self._ready is None:
            self._score(jobs)
        self._lengths = self._ready if self._ready is not None else self._decide(jobs)
        self._ready = None
        for job_id, length in self._lengths.items():
            if length:
                self._shadows.pop(job_id, None)  # its own draft's fate is reported (`observe`)
        prepare = getattr(self.source, "prepare", None)
        if prepare is not None:
            await prepare(jobs, self._lengths)

    def would_draft(self, jobs, drawn: Mapping[int, Sequence[int]] | None = None) -> bool:
        """Whether a pass planned afresh now would draft: asked while passes are planned ahead, so that a
        pass is planned afresh (the pipeline's cost) only when it drafts. `drawn`: each job's tokens drawn
        by passes whose results are not applied yet (a peeking source drafts after them). Its lengths are
        kept for `begin`."""
        started = time.perf_counter()
        self._lanes = max(1, len(jobs))
        self._score(jobs)
        drafts = None
        if self._peek is not None and self.control:
            drafts = {job.id: () for job in jobs}
            peeked = jobs
            if len(jobs) > PEEKS:
                self._turn = (self._turn + PEEKS) % len(jobs)
                peeked = [jobs[(self._turn + i) % len(jobs)] for i in range(PEEKS)]
            for job in peeked:
                after = drawn.get(job.id, ()) if drawn else ()
                drafts[job.id] = draft = self._peek(job, after, self.most) if not job.media else ()
                self._shadows[job.id] = (len(job.generated) + len(after), draft)
        lengths = self._decide(jobs, drafts)
        self._ready = lengths if any(lengths.values()) else None
        self._asked = time.perf_counter() - started
        return self._ready is not None

    def asks_every(self) -> int:
        """How many passes planned ahead go by between asks (`would_draft`): each ask may cost ASK_SHARE of
        the passes it spans, so a CPU's slow passes ask every time and a GPU's 64 fast lanes seldom."""
        if not (self.ahead.known and self.control):
            return 1
        span = self._asked / (ASK_SHARE * max(self.ahead.seconds(self._lanes), 1e-6))
        return max(1, min(MOST_ASK, math.ceil(span)))

    def _decide(self, jobs, drafts: Mapping[int, tuple[int, ...]] | None = None) -> dict[int, int]:
        self._unseen += 1
        if self._unseen > EXPLORE and self.control:
            # Drafting that always pays by the fresh cost alone would never learn what a plain pass ahead costs.
            self._unseen = 0
            return {job.id: 0 for job in jobs}
        lengths = self._choose(jobs, drafts)
        if not lengths:
            return lengths
        if any(lengths.values()):
            self._idle, self._probe_every = 0, PROBE
            return lengths
        # Without a probe a noisy fit (a row dear, the fixed cost nothing) would stop drafting for good.
        self._idle += 1
        if self._idle % self._probe_every == 0:
            self._idle, self._probe_every = 0, min(2 * self._probe_every, MOST_PROBE)
            found = [job for job in lengths if drafts is None or drafts[job]]
            if found:
                lengths[max(found, key=lambda job: self._first_gain(job, drafts))] = 1
        return lengths

    def plan(self, jobs) -> dict[int, int]:
        """The draft lengths `begin` chose, by job id (the planner's `Drafter`)."""
        return self._lengths

    def _choose(self, jobs, drafts: Mapping[int, tuple[int, ...]] | None = None) -> dict[int, int]:
        """Each decoding job's draft length (by id) for the next pass; see the module's docstring. With
        `drafts` (peeked) a lane drafts at most its draft's length."""
        rates = {job.id: self._rates(job.id, self._kind(job.id, drafts)) for job in jobs}
        if not self.control:
            return dict.fromkeys(rates, self.most)
        lengths = dict.fromkeys(rates, 0)
        if self.most <= 0 or not rates:
            return lengths
        cost = self.fresh.seconds
        tokens, rows = float(len(rates)), float(len(rates))
        most = {job: self.most if drafts is None else min(self.most, len(drafts[job])) for job in rates}
        # lanes by their next draft token's expected gain, the largest first (ties: the earlier lane)
        gains = [(-self._first_gain(job, drafts), order, job) for order, job in enumerate(rates) if most[job]]
        heapq.heapify(gains)
        while gains:
            gain, order, job = gains[0]
            gain = -gain
            seconds = cost(rows)
            if seconds > 0 and gain * seconds <= tokens * (cost(rows + 1) - seconds):
                break  # no lane's next token pays for its row
            lengths[job] += 1
            tokens, rows = tokens + gain, rows + 1
            if lengths[job] >= most[job]:
                heapq.heappop(gains)
            else:
                heapq.heapreplace(gains, (-gain * rates[job][1], order, job))
        lanes, seconds = float(len(rates)), cost(rows)
        plain = lanes / max(self.ahead.seconds(lanes), 1e-9)
        if self.ahead.known and seconds > 0 and tokens / seconds <= MARGIN * plain:
            return dict.fromkeys(rates, 0)  # a plain pass planned ahead makes tokens about as fast as this draft
        return lengths

    def propose(self, job: Job, most: int) -> tuple[int, ...]:
        if most <= 0 or job.media:  # no drafts over images and videos
            return ()
        draft = self.source.propose(job, most)
        self._asked_source(job.id, bool(draft))
        if draft:
            self._kinds[job.id] = getattr(draft, "kind", None)
        return draft

    def _asked_source(self, job_id: int, found: bool) -> None:
        """The stream's source was asked (or a would-be draft scored): whether it found a draft, decayed."""
        hits, asked = self._found.get(job_id, FOUND_PRIOR)
        self._found[job_id] = (DECAY * hits + found, DECAY * asked + 1)

    def observe(self, job: Job, drafted: int, accepted: int) -> None:
        """A pass kept `accepted` of the `drafted` tokens proposed for `job`."""
        self.drafted += drafted
        self.accepted += accepted
        self.pieces += 1
        self._learn(job.id, self._kinds.get(job.id), drafted, accepted)

    def _learn(self, job_id: int, kind: Hashable, drafted: int, accepted: int) -> None:
        # tokens are tried in order until one fails: a draft of k with j kept tried j + 1 (k when all were),
        # its first and, when that was kept, min(k, j + 1) - 1 later ones
        outcome = (accepted > 0, 1, max(accepted - 1, 0), min(drafted, accepted + 1) - 1 if accepted else 0)
        self._record.setdefault(job_id, {})[kind] = _decayed(self._stream_record(job_id, kind), DECAY, outcome)
        self._shared[kind] = _decayed(self._shared.get(kind, RECORD_PRIOR), SHARED_DECAY, outcome)

    def _stream_record(self, job_id: int, kind: Hashable = None) -> Record:
        """The stream's decayed record; before its first draft's fate is known, the shared record's two rates
        at PRIOR_TRIALS' weight: a workload of copies starts its streams drafting long, one of prose short."""
        record = self._record.get(job_id, {}).get(kind)
        if record is None:
            kept, tried, kept_later, tried_later = self._shared.get(kind, RECORD_PRIOR)
            record = (kept / tried * PRIOR_TRIALS, PRIOR_TRIALS, kept_later / tried_later * PRIOR_TRIALS, PRIOR_TRIALS)
        return record

    def _score(self, jobs) -> None:
        """Would-be drafts against the tokens their lanes drew since: each one whose fate is known (a token
        differs, or all came) teaches the lane's record and its source's finding rate, as a drafted one would."""
        shadows = self._shadows
        for job in jobs:
            shadow = shadows.get(job.id)
            if shadow is None:
                continue
            start, draft = shadow
            drawn = job.generated[start:start + len(draft)]
            kept = next((i for i, (a, b) in enumerate(zip(draft, drawn)) if a != b), len(drawn))
            if kept == len(drawn) < len(draft):
                continue  # every token drawn so far agrees: wait for the rest
            del shadows[job.id]
            self._asked_source(job.id, bool(draft))
            if draft:
                self._learn(job.id, getattr(draft, "kind", None), len(draft), kept)

    def passed(self, rows: int, seconds: float, ahead: bool = False) -> None:
        """A decode pass of `rows` rows came back `seconds` after the one before it, planned ahead of that
        one's result or not: the matching cost model learns it."""
        (self.ahead if ahead else self.fresh).add(rows, seconds)
        self.times[ahead] = self.times[ahead].add(rows, seconds)
        if ahead:
            self._unseen = 0

    def _rates(self, job_id: int, kind: Hashable = None) -> tuple[float, float]:
        """A first draft token's chance of being kept, and a later one's given the ones before it were: the
        stream's decayed record, which starts as every stream's (`_stream_record`)."""
        kept, tried, kept_later, tried_later = self._stream_record(job_id, kind)
        return kept / tried, kept_later / tried_later

    def _first_gain(self, job_id: int, drafts: Mapping[int, tuple[int, ...]] | None = None) -> float:
        """A first draft token's expected gain: the source finds a draft for the stream (known when peeked),
        and it is kept."""
        if drafts is not None:
            return self._rates(job_id, self._kind(job_id, drafts))[0] if drafts[job_id] else 0.0
        found, asked = self._found.get(job_id, FOUND_PRIOR)
        return found / asked * self._rates(job_id, self._kind(job_id))[0]

    def _kind(self, job_id: int, drafts: Mapping[int, tuple[int, ...]] | None = None) -> Hashable:
        """The kind of the stream's draft: the one peeked, else its latest one's."""
        if drafts is not None and drafts.get(job_id):
            return getattr(drafts[job_id], "kind", None)
        return self._kinds.get(job_id)

    def ended(self, job: Job) -> None:
        self._record.pop(job.id, None)
        self._kinds.pop(job.id, None)
        self._found.pop(job.id, None)
        self._shadows.pop(job.id, None)
        self.source.forget(job)

    def statistics(self) -> DraftStats:
        return DraftStats(self.drafted, self.accepted, self.pieces, self.times[False], self.times[True])


def _decayed(record: Record, decay: float, outcome: tuple) -> Record:
    """A (kept, tried, kept later, tried later) record with one draft's outcome added after decaying the rest."""
    return tuple(decay * value + new for value, new in zip(record, outcome))  # type: ignore[return-value]
