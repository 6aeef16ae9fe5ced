"""What one pass asks of a backend: each lane's new rows, where they sit, and which logits to return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Logits = Literal["last", "all", "none"]


@dataclass(frozen=True, init=False)
class Piece:
    """One lane's rows in a pass: `tokens` at positions `start`.., over the lane's block table.

    `blocks` covers at least `start + len(tokens)` tokens. `logits` picks the rows whose logits the pass
    returns: the last row (the next token), every row (prompt logprobs), or none (a middle chunk).
    """

    lane: int
    tokens: tuple[int, ...]
    start: int
    blocks: tuple[int, ...]
    logits: Logits = "last"

    def __init__(self, lane: int, tokens: tuple[int, ...], start: int, blocks: tuple[int, ...], logits: Logits = "last") -> None:
        # One a row a pass: the instance dict filled at once, not through object.__setattr__ a field.
        if not tokens:
            raise ValueError("a piece needs at least one token")
        if start < 0:
            raise ValueError("a piece cannot start before position 0")
        fields = self.__dict__
        fields["lane"], fields["tokens"], fields["start"], fields["blocks"], fields["logits"] = lane, tokens, start, blocks, logits

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def logit_rows(self) -> int:
        return {"last": 1, "all": len(self.tokens), "none": 0}[self.logits]
