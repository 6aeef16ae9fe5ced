"""Drafting: how many tokens each lane drafts, and asking its source for them.

The one owner of each stream's draft record (its draft tokens kept and tried, decayed) and of two models
of the decode passes' cost (seconds = fixed + per row x rows, learnt from the passes themselves, each
timed from the result of the pass before): passes planned afresh after that result, as a drafted pass
must be, and passes planned ahead of it (or fed behind it on the device), whose host work hides under
the device's. Before a pass it gives each lane the draft length that most raises the pass's expected
tokens a second: a lane whose draft tokens are each kept with chance a (given the ones before it were)
gains a^(k+1) expected tokens from its (k+1)-th draft token, which costs one row; a lane drafts one more
token while that gain beats the pass's current tokens a second times a row's cost. Then the drafted pass
must beat a plain pass planned ahead, at its rate, or nothing is drafted: on a GPU a pass planned ahead
costs a fraction of one planned afresh. So a lane whose drafts fail, or a pass big enough that rows are
dear, drafts nothing. A lane's gains are also weighed by how often its source found a draft when asked:
a dry ask costs no row, but its pass could not be planned ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .job import Job

PRIOR = 0.6  # the acceptance a stream's first drafts are planned with
PRIOR_TRIALS = 2.0  # the prior's weight in draft tokens tried, decayed like a stream's own
RECORD_PRIOR = (PRIOR * PRIOR_TRIALS, PRIOR_TRIALS)  # a stream's first record (kept, tried)
DECAY = 0.8  # the weight of a stream's past drafts against its latest one
FOUND_PRIOR = (1.0, 1.0)  # a stream's source is first taken to find a draft whenever asked (found, asked)
COST_DECAY = 0.95  # the weight of past passes in the cost model
PROBE = 16  # every 16th decision that would draft nothing drafts one token: rates and costs stay learnt


class DraftSource(Protocol):
    """Where drafts come from (`lanes.drafts`): n-grams of a stream's own context, a suffix index, a model."""

    def propose(self, job: Job, most: int) -> tuple[int, ...]:
        """Up to `most` tokens that may follow the stream's context (its prompt and generated tokens)."""
        ...

    def forget(self, job: Job) -> None:
        """The stream has ended: what is kept for it alone goes (what it taught a shared index stays)."""
        ...


class CostLine:
    """Seconds a pass as fixed + per row x rows: a least-squares line over decayed sums of the passes seen."""

    def __init__(self) -> None:
        self.fixed, self.per_row = 0.0, 0.0
        self._sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # decayed sums of 1, rows, rows^2, seconds, rows x seconds

    @property
    def known(self) -> bool:
        return self._sums[0] > 0

    def seconds(self, rows: float) -> float:
        return self.fixed + self.per_row * rows

    def add(self, rows: int, seconds: float) -> None:
        s = self._sums
        for i, value in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            s[i] = COST_DECAY * s[i] + value
        spread = s[0] * s[2] - s[1] * s[1]
        if spread > 1e-9 * max(1.0, s[2]):
            self.per_row = max(0.0, (s[0] * s[4] - s[1] * s[3]) / spread)
        self.fixed = max(0.0, (s[3] - self.per_row * s[1]) / s[0])


@dataclass(frozen=True)
class DraftStats:
    drafted: int  # draft tokens proposed in passes
    accepted: int  # of those, kept
    pieces: int  # drafted pieces (a lane's draft in one pass)

    @property
    def mean_accepted(self) -> float:
        """Draft tokens kept a drafted piece."""
        return self.accepted / self.pieces if self.pieces else 0.0


class Drafting:
    """The planner's drafter (`planner.Drafter`): `propose` for each decoding lane of a pass; the pass loop
    reports each pass's cost (`passed`) and its drafts' fate (`observe`), and each stream's end (`ended`);
    while passes are planned ahead it asks, now and then, whether a fresh plan would draft (`would_draft`)."""

    def __init__(self, source: DraftSource, most: int, control: bool = True) -> None:
        self.source, self.most = source, most
        self.control = control  # off: every lane drafts `most` (tests and the fuzzer, which run in virtual time)
        self._record: dict[int, tuple[float, float]] = {}  # job id -> draft tokens kept and tried, decayed
        self._found: dict[int, tuple[float, float]] = {}  # job id -> times its source found a draft and was asked
        self._lengths: dict[int, int] = {}  # job id -> its draft length in the pass being planned (`begin`)
        self._ready: dict[int, int] | None = None  # lengths `would_draft` chose, for the fresh plan it asked for
        self.fresh, self.ahead = CostLine(), CostLine()  # passes planned after their predecessor's result, and ahead of it
        self._idle = 0  # decisions that drafted nothing
        self.drafted = self.accepted = self.pieces = 0

    async def begin(self, jobs) -> None:
        """Before a pass is planned: each decoding job's draft length, and the source's drafts made ready
        where making them takes a model's passes (off the event loop)."""
        self._lengths = self._ready if self._ready is not None else self._decide(jobs)
        self._ready = None
        prepare = getattr(self.source, "prepare", None)
        if prepare is not None:
            await prepare(jobs, self._lengths)

    def would_draft(self, jobs) -> bool:
        """Whether a pass planned afresh now would draft: asked while passes are planned ahead, so that a
        pass is planned afresh (the pipeline's cost) only when it drafts. Its lengths are kept for `begin`."""
        lengths = self._decide(jobs)
        self._ready = lengths if any(lengths.values()) else None
        return self._ready is not None

    def _decide(self, jobs) -> dict[int, int]:
        lengths = self._choose(jobs)
        if lengths and not any(lengths.values()):
            # Without a probe a noisy fit (a row dear, the fixed cost nothing) would stop drafting for good.
            self._idle += 1
            if self._idle % PROBE == 0:
                lengths[max(lengths, key=self._first_gain)] = 1
        return lengths

    def plan(self, jobs) -> dict[int, int]:
        """The draft lengths `begin` chose, by job id (the planner's `Drafter`)."""
        return self._lengths

    def _choose(self, jobs) -> dict[int, int]:
        """Each decoding job's draft length (by id) for the next pass; see the module's docstring."""
        rates = {job.id: self._rate(job.id) for job in jobs}
        if not self.control:
            return dict.fromkeys(rates, self.most)
        lengths = dict.fromkeys(rates, 0)
        if self.most <= 0 or not rates:
            return lengths
        fixed, per_row = self.fresh.fixed, self.fresh.per_row
        tokens, rows = float(len(rates)), float(len(rates))
        gains = {job: self._first_gain(job) for job in rates}  # the next draft token's expected gain, a lane
        while gains:
            job, gain = max(gains.items(), key=lambda item: item[1])
            seconds = fixed + per_row * rows
            if seconds > 0 and gain * seconds <= tokens * per_row:
                break  # no lane's next token pays for its row
            lengths[job] += 1
            tokens, rows = tokens + gain, rows + 1
            if lengths[job] >= self.most:
                del gains[job]
            else:
                gains[job] = gain * rates[job]
        lanes, seconds = float(len(rates)), fixed + per_row * rows
        if self.ahead.known and seconds > 0 and tokens / seconds <= lanes / max(self.ahead.seconds(lanes), 1e-9):
            return dict.fromkeys(rates, 0)  # a plain pass planned ahead makes tokens faster than this draft
        return lengths

    def propose(self, job: Job, most: int) -> tuple[int, ...]:
        if most <= 0 or job.media:  # no drafts over images and videos
            return ()
        draft = self.source.propose(job, most)
        found, asked = self._found.get(job.id, FOUND_PRIOR)
        self._found[job.id] = (DECAY * found + bool(draft), DECAY * asked + 1)
        return draft

    def observe(self, job: Job, drafted: int, accepted: int) -> None:
        """A pass kept `accepted` of the `drafted` tokens proposed for `job`."""
        self.drafted += drafted
        self.accepted += accepted
        self.pieces += 1
        # tokens are tried in order until one fails: a draft of k with j kept tried j + 1 (k when all were)
        kept, tried = self._record.get(job.id, RECORD_PRIOR)
        self._record[job.id] = (DECAY * kept + accepted, DECAY * tried + min(drafted, accepted + 1))

    def passed(self, rows: int, seconds: float, ahead: bool = False) -> None:
        """A decode pass of `rows` rows came back `seconds` after the one before it, planned ahead of that
        one's result or not: the matching cost line learns it."""
        (self.ahead if ahead else self.fresh).add(rows, seconds)

    def _rate(self, job_id: int) -> float:
        """A draft token's chance of being kept, given the ones before it were: the stream's decayed record,
        which starts as the prior's."""
        kept, tried = self._record.get(job_id, RECORD_PRIOR)
        return kept / tried

    def _first_gain(self, job_id: int) -> float:
        """A first draft token's expected gain: the source finds a draft for the stream, and it is kept."""
        found, asked = self._found.get(job_id, FOUND_PRIOR)
        return found / asked * self._rate(job_id)

    def ended(self, job: Job) -> None:
        self._record.pop(job.id, None)
        self._found.pop(job.id, None)
        self.source.forget(job)

    def statistics(self) -> DraftStats:
        return DraftStats(self.drafted, self.accepted, self.pieces)
