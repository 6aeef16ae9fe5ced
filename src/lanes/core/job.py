"""A job: a stream, a warm pass or a decision's prefill, as the lane core tracks it.

Each field has one writer (tests/test_core_owners.py checks that each is assigned in one place):
- its request's (id, kind, prompt, sampling, limit, deadline, media, labels, owner, into_cache, text,
  stops, key, max_new): fixed when the job is made;
- the lane table (`lanes.LaneTable`), which binds and frees lanes and advances them by each pass's result:
  `phase`, `lane`, `table`, `cancelled`, `outcome`, `paused`, `done`, `generated` (appended), `pending`,
  `prompt_logprobs` (appended), `read`;
- admission (`admission.Admission`): `cached`, `kept`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from .blocks import BlockTable
from .media import cache_key
from .sampling import SamplingParams
from .stream import Failed, Finished


class Phase(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


JobKind = Literal["stream", "warm", "trunk", "branch"]  # trunk and branch: a decision's prefills


@dataclass(eq=False)
class Job:
    """See the module's docstring for who writes each field."""

    id: int
    kind: JobKind
    prompt: tuple[int, ...]
    sampling: SamplingParams
    limit: int  # most tokens of context: the prompt and every token it may generate
    deadline: float = float("inf")
    media: tuple = ()  # PromptMedia in the prompt, handed to the backend when the job takes a lane
    labels: tuple[int, ...] = ()  # a branch's label tokens, read at the row after its prompt
    owner: object = None  # the DecisionJob a trunk or branch belongs to
    into_cache: bool = False  # a warm pass whose blocks go to the prompt cache, not to its asker
    text: object = None  # a stream's TextAssembler: push(token) -> (text, stopped), finish() -> text
    stops: frozenset[int] = frozenset()  # the tokens that end a stream
    # the lane table's
    phase: Phase = Phase.QUEUED
    lane: int | None = None
    table: BlockTable | None = None
    cancelled: bool = False
    outcome: Finished | Failed | None = None
    paused: bool = False  # its consumer is far behind: no decode rows until it has read (lane kept)
    done: int = 0  # context tokens whose KV is in the lane's blocks
    generated: list[int] = field(default_factory=list)
    pending: int | None = None  # the last drawn token, fed to the next decode row
    prompt_logprobs: list = field(default_factory=list)
    read: object = None  # a branch's LabelRead, once its last row has run
    # admission's
    cached: int = 0  # prompt tokens restored from the prompt cache
    kept: bool = False  # the prompt's full blocks have been offered to the prompt cache

    def __post_init__(self) -> None:
        self.key = cache_key(self.prompt, self.media)  # the prompt as the prompt cache keys it
        self.max_new = self.limit - len(self.prompt)  # read for every row of every pass

    @property
    def capacity(self) -> int:
        """KV slots its lane holds: every context token but the last drawn (never fed back), or the whole
        prompt when it draws nothing (max_tokens 0)."""
        return self.limit - 1 if self.max_new else self.limit

    @property
    def live(self) -> bool:
        """In a lane, wanted, and not finished: it gets rows in the next pass."""
        return self.phase in (Phase.PREFILL, Phase.DECODE) and not self.cancelled and self.outcome is None
