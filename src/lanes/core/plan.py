"""One pass as plain data: the frozen `Plan` the lane core hands a backend and the `PassResult` it gets back.

A plan is small and typed so that it can also be broadcast to tensor-parallel followers, which run the
same pass on their shards without deciding anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .passes import Piece
from .sampling import RowSampling


@dataclass(frozen=True, init=False)
class Work:
    """One lane's part of a pass: its rows, and what to read from them.

    `sample`: draw the lane's next token from the piece's last row. `draft`: tokens proposed after the
    piece's first (decode) token, which are its other rows; every row is drawn and the longest prefix of
    the draft that the draws confirm is accepted, with the draw after it (`Sampled.tokens`). `targets`:
    for prompt logprobs, the token that follows each row (one per row, or one fewer when the last row's
    follower is the sampled token); `top` is how many alternatives to report with each. `labels`: a
    decision's read of the last row: these tokens' logprobs (their logits less the row's logsumexp).
    """

    piece: Piece
    sample: RowSampling | None = None
    targets: tuple[int, ...] = ()
    top: int = 0
    labels: tuple[int, ...] = ()
    draft: tuple[int, ...] = ()

    def __init__(self, piece: Piece, sample: RowSampling | None = None, targets: tuple[int, ...] = (), top: int = 0,
                 labels: tuple[int, ...] = (), draft: tuple[int, ...] = ()) -> None:
        # One a row a pass: the instance dict filled at once, where a frozen dataclass's own __init__ would
        # call object.__setattr__ for each field (three times slower).
        fields = self.__dict__
        fields["piece"], fields["sample"], fields["targets"] = piece, sample, targets
        fields["top"], fields["labels"], fields["draft"] = top, labels, draft


@dataclass(frozen=True)
class Plan:
    """A pass: prompt chunks (at most 16, `prefills` of them, first) and then the decode rows of live lanes.

    The planner decides once, for the backend and for the pass loop, what the pass allows:
    `plain`: every work is a stream's draw that is the raw logits' argmax, reporting at most its logprob,
    with no draft, targets or labels (a captured graph's greedy draw gives exactly it); `ahead`: only
    streams' decode rows without penalties, so the next pass can be planned from this one's result
    before it is applied; `fed`: every row is a decode row whose token is the one the pass before drew
    for its lane, read on the device (its pieces hold a stand-in token); only backends whose shape
    `feeds` are given such plans, queued behind a plain `ahead` pass."""

    step: int
    work: tuple[Work, ...]
    prefills: int
    fed: bool = False
    plain: bool = False
    ahead: bool = False
    drafted: int = 0  # draft tokens in the plan's decode rows (each a row beside its lane's first)

    @cached_property  # a backend reads them several times a pass
    def pieces(self) -> tuple[Piece, ...]:
        return tuple(w.piece for w in self.work)

    @property
    def rows(self) -> int:
        return sum(len(w.piece.tokens) for w in self.work)

    @property
    def prefill_rows(self) -> int:
        return sum(len(w.piece.tokens) for w in self.work[: self.prefills])

    @property
    def decode_rows(self) -> int:
        return len(self.work) - self.prefills + self.drafted

    @property
    def feedable(self) -> bool:
        """A fed pass may be queued behind this one (its draws are on the device, one token a lane)."""
        return self.plain and self.ahead


@dataclass(frozen=True, init=False)
class Sampled:
    """What a work's rows added: the tokens drawn (one, or a draft's accepted tokens and the draw after
    them), each with its logprob and its top alternatives (token, logprob) when asked for."""

    tokens: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]

    def __init__(self, tokens: tuple[int, ...], logprobs: tuple[float | None, ...] | None = None,
                 top: tuple[tuple[tuple[int, float], ...], ...] | None = None) -> None:
        fields = self.__dict__  # one a row a pass: filled at once (as `Work`)
        fields["tokens"] = tokens
        one = len(tokens) == 1
        fields["logprobs"] = logprobs if logprobs is not None else _NONE if one else (None,) * len(tokens)
        fields["top"] = top if top is not None else _NO_TOP if one else ((),) * len(tokens)

    @property
    def token(self) -> int:
        """The last token drawn: the one the lane's next row is fed."""
        return self.tokens[-1]


_NONE, _NO_TOP = (None,), ((),)  # one token's missing logprob and alternatives


def accepted(draft: tuple[int, ...], draws: list[int]) -> int:
    """How many of `draws` (a draw at each of a drafted piece's rows) stand: the draft's tokens that the draw
    before each confirms, and the draw after the last of them."""
    n = 0
    while n < len(draft) and draft[n] == draws[n]:
        n += 1
    return n + 1


@dataclass(frozen=True)
class TargetLogprobs:
    """Logprobs of a piece's target tokens, with the top alternatives of each row."""

    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class LabelRead:
    """A decision's read: each label's logprob at the row after the prompt, and whether the whole
    vocabulary's most likely token is one of the labels."""

    logprobs: tuple[float, ...]
    argmax_is_label: bool


@dataclass(frozen=True)
class PassResult:
    """What a pass gives back, one entry per `Work` of the plan in order (None where nothing was asked);
    `reads` may be empty when the plan asked for none."""

    sampled: tuple[Sampled | None, ...]
    prompt_logprobs: tuple[TargetLogprobs | None, ...]
    reads: tuple[LabelRead | None, ...] = ()
