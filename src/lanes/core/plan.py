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

    `sample`: draw the lane's next token from the piece's last row. `targets`: for prompt logprobs, the token
    that follows each row (one per row, or one fewer when the last row's follower is the sampled token);
    `top` is how many alternatives to report with each. `labels`: a decision's read of the last row: these
    tokens' logprobs (their logits less the row's logsumexp).
    """

    piece: Piece
    sample: RowSampling | None = None
    targets: tuple[int, ...] = ()
    top: int = 0
    labels: tuple[int, ...] = ()

    def __init__(self, piece: Piece, sample: RowSampling | None = None, targets: tuple[int, ...] = (), top: int = 0,
                 labels: tuple[int, ...] = ()) -> None:
        # One a row a pass: the instance dict filled at once, where a frozen dataclass's own __init__ would
        # call object.__setattr__ for each field (three times slower).
        fields = self.__dict__
        fields["piece"], fields["sample"], fields["targets"] = piece, sample, targets
        fields["top"], fields["labels"] = top, labels


@dataclass(frozen=True)
class Plan:
    """A pass: prompt chunks (at most 16, `prefills` of them, first) and then one decode row a live lane.

    `fed`: every row is a decode row whose token is the one the pass before drew for its lane, read on the
    device (its pieces hold a stand-in token); only backends whose shape `feeds` are given such plans."""

    step: int
    work: tuple[Work, ...]
    prefills: int
    fed: bool = False

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
        return len(self.work) - self.prefills


@dataclass(frozen=True, init=False)
class Sampled:
    """A drawn token with its logprob and the top alternatives (token, logprob), when asked for."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()

    def __init__(self, token: int, logprob: float | None = None, top: tuple[tuple[int, float], ...] = ()) -> None:
        fields = self.__dict__  # one a row a pass: filled at once (as `Work`)
        fields["token"], fields["logprob"], fields["top"] = token, logprob, top


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
