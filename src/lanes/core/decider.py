"""The decider queue: decisions wait here and take free lanes as synthetic streams beside live ones.

A decision is several branches (one a question) that share a trunk: their longest common prefix in full
blocks. The trunk is prefilled once in a lane (kept in the prompt cache when there is one), then held by
the decision itself, and every branch adopts it, prefills its own suffix and reads its label logits at its
last row; no token is ever drawn. Branches run in as many free lanes as there are, batched in the same
passes. Streams waiting for a lane always go first; a decision that cannot get a lane or blocks stays at
the head of the queue for the next gap; a live stream is never moved.

Like the block pool and the prompt cache, this is synchronous state on the Trio thread, called only by the
lane core at its mailbox and by admission at pass boundaries; it takes lanes and blocks only through its
`Placement` (admission), never from the lane core itself.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Protocol, Sequence

from .commands import Reply
from .job import Job
from .media import PromptMedia, check_media
from .plan import LabelRead
from .sampling import InvalidParameter, SamplingParams
from .stream import EngineError, Finished, QueueFull


class Placement(Protocol):
    """What the decider asks of admission: ids, lanes with their blocks, holds on blocks, the prompt cache."""

    block_size: int

    def new_id(self) -> int: ...

    def place_prefix(self, job: Job, free: list[int]) -> bool:
        """`job` (a trunk) into `free[0]`, restored from the prompt cache where it can; False without room."""
        ...

    def place_after(self, job: Job, free: list[int], shared: Sequence[int], tokens: int) -> bool:
        """`job` (a branch) into `free[0]` over `shared`, blocks holding its first `tokens`; False without room."""
        ...

    def hold(self, owner: Hashable, blocks: Sequence[int]) -> None: ...

    def let_go(self, owner: Hashable) -> None: ...

    def keep(self, key: Sequence, blocks: Sequence[int]) -> None: ...

    def cancel(self, job: Job) -> None: ...

    def jobs_in_lanes(self) -> Iterator[Job]: ...

    def streams_in_lanes(self) -> bool: ...


class DecisionTimeout(EngineError):
    """The decision did not finish before its deadline."""

    def __init__(self) -> None:
        super().__init__("the decision did not finish before its deadline")


class DecisionCancelled(EngineError):
    """The client that asked went away."""

    def __init__(self) -> None:
        super().__init__("the decision was cancelled")


@dataclass(frozen=True)
class DecisionRequest:
    """Each branch's whole prompt and the label tokens read after it; `deadline` (trio time) bounds it all.
    `media` are the images every prompt holds, the same rows in each (inside their common prefix)."""

    prompts: tuple[tuple[int, ...], ...]
    labels: tuple[tuple[int, ...], ...]
    deadline: float = math.inf
    media: tuple[PromptMedia, ...] = ()


@dataclass(frozen=True)
class DecisionResult:
    reads: tuple[LabelRead, ...]
    input_tokens: int  # the tokens the decision's prompts hold, the trunk counted once
    cached_tokens: int  # of those, restored from the prompt cache instead of computed


@dataclass(eq=False)
class DecisionJob:
    id: int
    key: Hashable  # the asker's handle, for cancellation
    request: DecisionRequest
    reply: Reply
    trunk: tuple[int, ...]
    pending: deque[int]  # branches still waiting for a lane
    reads: list[LabelRead | None]
    running: set[int] = field(default_factory=set)  # job ids of its trunk or branches in lanes
    trunk_blocks: list[int] = field(default_factory=list)  # in position order, held under `owner`
    trunk_ready: bool = False
    restored: int = 0  # trunk tokens its lane restored from the prompt cache

    @property
    def owner(self) -> tuple[str, int]:
        return ("decision", self.id)


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all `prompts` share."""
    shortest = min(len(p) for p in prompts)
    common = 0
    while common < shortest and all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    return common


def shared_trunk(prompts: Sequence[Sequence[int]], block_size: int,
                 media: Sequence[PromptMedia] = ()) -> tuple[int, ...]:
    """The longest common prefix of two or more prompts, in whole blocks, leaving every branch a suffix and
    never ending inside an image's rows (a lane binds whole images: its rows' positions need the grid)."""
    if len(prompts) < 2:
        return ()
    length = min(common_prefix(prompts), min(len(p) for p in prompts) - 1) // block_size * block_size
    for item in reversed(media):  # later images first: cutting before one may cut through the one before it
        if item.start < length < item.end:
            length = item.start // block_size * block_size
    return tuple(prompts[0][:length])


class Decider:
    """Queued and running decisions, with their deadlines; the lane core calls in at the right moments."""

    def __init__(self, placement: Placement, max_queue: int, idle_only: bool = False) -> None:
        self._placement = placement
        self.max_queue = max_queue
        self.idle_only = idle_only  # the policy to compare against: decisions only when no stream is live
        self.queue: deque[DecisionJob] = deque()
        self.running: dict[int, DecisionJob] = {}
        self.counts = dict(asked=0, answered=0, failed=0)

    # ---- from the mailbox ----

    def submit(self, request: DecisionRequest, reply: Reply, key: Hashable, job_id: int) -> None:
        if len(self.queue) >= self.max_queue:
            reply.fail(QueueFull(len(self.queue)))
            return
        try:
            check_media(common_prefix(request.prompts), request.media)
        except InvalidParameter as error:
            reply.fail(error)
            return
        trunk = shared_trunk(request.prompts, self._placement.block_size, request.media)
        self.queue.append(DecisionJob(job_id, key, request, reply, trunk, deque(range(len(request.prompts))),
                                      [None] * len(request.prompts)))
        self.counts["asked"] += 1

    def cancel(self, key: Hashable) -> None:
        for decision in list(self.queue) + list(self.running.values()):
            if decision.key == key:
                self.fail(decision, DecisionCancelled())

    # ---- at boundaries ----

    def admit_running(self, free: list[int]) -> None:
        """Give free lanes to the branches of decisions already under way (oldest first): they hold their
        trunks' blocks, so letting them finish is what frees those blocks for a stream at the queue's head."""
        if self._held_back():
            return
        for decision in sorted(self.running.values(), key=lambda d: d.id):
            if not self._admit_branches(decision, free):
                return  # out of blocks: later ones wait behind it

    def admit_queued(self, free: list[int]) -> None:
        """Start the queue's head in free lanes (called only when no stream waits for a lane)."""
        if self._held_back():
            return
        while free and self.queue:
            decision = self.queue[0]
            if decision.trunk:
                if not self._admit_trunk(decision, free):
                    return  # Busy: it stays at the head for the next gap
            self.queue.popleft()
            self.running[decision.id] = decision
            if not decision.trunk:
                decision.trunk_ready = True
                if not self._admit_branches(decision, free):
                    return

    def _held_back(self) -> bool:
        return self.idle_only and self._placement.streams_in_lanes()

    def _admit_trunk(self, decision: DecisionJob, free: list[int]) -> bool:
        placement = self._placement
        media = tuple(m for m in decision.request.media if m.end <= len(decision.trunk))  # the trunk's own images
        job = Job(placement.new_id(), "trunk", decision.trunk, SamplingParams(), len(decision.trunk), owner=decision,
                  media=media)
        if not placement.place_prefix(job, free):
            return False
        decision.running.add(job.id)
        return True

    def _admit_branches(self, decision: DecisionJob, free: list[int]) -> bool:
        """Admit its waiting branches into free lanes; False when the pool has no room for the next one."""
        placement = self._placement
        while decision.trunk_ready and decision.pending and free:
            index = decision.pending[0]  # the branch's place in the request
            prompt = decision.request.prompts[index]
            job = Job(placement.new_id(), "branch", prompt, SamplingParams(), len(prompt), owner=decision,
                      labels=decision.request.labels[index], media=decision.request.media)
            shared = decision.trunk_blocks if decision.trunk else ()
            if not placement.place_after(job, free, shared, len(decision.trunk) if shared else 0):
                return False
            decision.pending.popleft()
            decision.running.add(job.id)
        return True

    def unbound(self, job: Job) -> None:
        """A trunk or branch left its lane (finished, or cancelled with its decision)."""
        decision: DecisionJob = job.owner
        decision.running.discard(job.id)
        if decision.id not in self.running or job.cancelled:
            return
        if not isinstance(job.outcome, Finished) or job.done != len(job.prompt):
            self.fail(decision, DecisionCancelled())  # a part ended before its prompt ran: nothing to answer with
            return
        if job.kind == "trunk":
            full = len(decision.trunk) // self._placement.block_size
            blocks = job.table.blocks[:full]
            self._placement.hold(decision.owner, blocks)  # the branches adopt these; the lane lets go
            decision.trunk_blocks = list(blocks)
            self._placement.keep(job.key, blocks)  # keyed with its images' digests, as streams are
            decision.restored = job.cached
            decision.trunk_ready = True
            return
        decision.reads[job_index(decision, job)] = job.read
        if all(r is not None for r in decision.reads):
            self._answer(decision)

    def _answer(self, decision: DecisionJob) -> None:
        del self.running[decision.id]
        self._placement.let_go(decision.owner)
        trunk = len(decision.trunk)
        total = trunk + sum(len(p) - trunk for p in decision.request.prompts)
        decision.reply.set(DecisionResult(tuple(decision.reads), total, decision.restored))
        self.counts["answered"] += 1

    def fail(self, decision: DecisionJob, error: EngineError) -> None:
        """End a decision with `error`: its jobs in lanes are cancelled (freed at the next boundary)."""
        if decision in self.queue:
            self.queue.remove(decision)
        elif self.running.pop(decision.id, None) is None:
            return
        for job in self._placement.jobs_in_lanes():
            if job.owner is decision:
                self._placement.cancel(job)
        self._placement.let_go(decision.owner)
        decision.reply.fail(error)
        self.counts["failed"] += 1

    def expire(self, now: float) -> None:
        for decision in list(self.queue) + list(self.running.values()):
            if decision.request.deadline <= now:
                self.fail(decision, DecisionTimeout())

    def earliest_deadline(self) -> float:
        return min((d.request.deadline for d in list(self.queue) + list(self.running.values())), default=math.inf)

    def fail_queued(self, error: EngineError) -> None:
        """Decisions not started yet end with `error`; those under way go on."""
        for decision in list(self.queue):
            self.fail(decision, error)

    def fail_all(self, error: EngineError) -> None:
        for decision in list(self.queue) + list(self.running.values()):
            self.fail(decision, error)

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.running)


def job_index(decision: DecisionJob, job: Job) -> int:
    """Which branch `job` is: the branches' prompts are matched by the job's own prompt and labels."""
    for index, (prompt, labels) in enumerate(zip(decision.request.prompts, decision.request.labels)):
        if decision.reads[index] is None and prompt == job.prompt and labels == job.labels:
            return index
    raise AssertionError(f"branch job {job.id} matches no open branch of decision {decision.id}")
