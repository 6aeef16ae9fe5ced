"""A stream's grammar beside the sampler: the plain `Grammar` a request carries, and `LaneGrammars`, each
bound lane's matcher, its token masks for a pass's drawn rows and its advance by the tokens each pass keeps.

The engine behind a matcher is the backend's (llguidance in `lanes.grammar`, a toy on the fake backend);
this module holds the bookkeeping both share, so drafts are masked and rolled back the same way on each.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from .plan import Sampled, Work


@dataclass(frozen=True)
class Grammar:
    """A constraint on a stream's tokens as plain text (it travels in plans to followers, which ignore it):
    `source` is what the backend's engine compiles (llguidance's grammar), `what` names it in messages."""

    source: str
    what: str = "grammar"


class Matcher(Protocol):
    """One stream's grammar state, advanced token by token and rolled back."""

    def fill(self, mask: np.ndarray) -> None:
        """Write the tokens allowed next into `mask` ([W] int32, bit t%32 of word t//32 for token t)."""
        ...

    def consume(self, tokens: Sequence[int]) -> bool:
        """Advance by `tokens`; False if one is not allowed (the matcher then allows only its end tokens)."""
        ...

    def validate(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows in turn (the state does not change)."""
        ...

    def rollback(self, count: int) -> None:
        """Undo the last `count` tokens consumed."""
        ...


def words(vocab: int) -> int:
    """int32 words of one row's mask."""
    return (vocab + 31) // 32


@dataclass(frozen=True)
class Masks:
    """A pass's masks: `rows[i]` is the index, among the pass's drawn rows in plan order, that `bits[i]` masks.
    bits: [G, W] int32 on the host."""

    rows: tuple[int, ...]
    bits: np.ndarray


class LaneGrammars:
    """Each bound lane's matcher. `bind` and `unbind` queue their change; `flush` makes them (building the
    matchers) at the start of a pass, in the pass's own thread, so no matcher changes under a running pass
    and none is compiled on the event loop. Only the pass's thread touches matchers."""

    def __init__(self, vocab: int, make: Callable[[Grammar], Matcher] | None) -> None:
        self.vocab = vocab
        self._make = make
        self._matchers: dict[int, Matcher] = {}
        self._bound: set[int] = set()
        self._writes: deque[tuple[int, Grammar | None]] = deque()  # appended on the event loop, taken in a pass
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # masks beside a pass's forward

    def is_bound(self, lane: int) -> bool:
        return lane in self._bound

    def bind(self, lane: int, grammar: Grammar) -> None:
        if self._make is None:
            raise ValueError("this backend has no grammar engine")  # the server refuses such requests before
        if lane in self._bound:
            raise ValueError(f"lane {lane} is already bound to a grammar")
        self._bound.add(lane)
        self._writes.append((lane, grammar))

    def unbind(self, lane: int) -> None:
        if lane not in self._bound:
            raise ValueError(f"lane {lane} has no grammar")
        self._bound.discard(lane)
        self._writes.append((lane, None))

    def flush(self) -> None:
        """The matchers of every bind and unbind since the last flush, in order."""
        writes = self._writes
        while writes:
            lane, grammar = writes.popleft()
            if grammar is None:
                self._matchers.pop(lane, None)
            else:
                self._matchers[lane] = self._make(grammar)

    def wanted(self, work: Sequence[Work]) -> bool:
        """Whether any drawn row of `work` is a constrained lane's."""
        matchers = self._matchers
        return bool(matchers) and any(w.sample is not None and w.piece.lane in matchers for w in work)

    def masks(self, work: Sequence[Work]) -> Masks | None:
        """Masks for the constrained lanes' drawn rows (None if there are none). A drafted piece's row i gets
        the mask after the draft's first i tokens; rows after a draft token the grammar refuses keep every
        token (they are void: the draw before cannot confirm it), and the matcher is rolled back after."""
        self.flush()
        if not self.wanted(work):
            return None
        rows: list[int] = []
        out: list[tuple[Matcher, Work, int]] = []
        at = 0
        for w in work:
            if w.sample is None:
                continue
            n = len(w.piece.tokens) if w.draft else 1
            matcher = self._matchers.get(w.piece.lane)
            if matcher is not None:
                rows.extend(range(at, at + n))
                out.append((matcher, w, n))
            at += n
        bits = np.full((len(rows), words(self.vocab)), -1, dtype=np.int32)
        g = 0
        for matcher, w, n in out:
            matcher.fill(bits[g])
            valid = matcher.validate(w.draft) if w.draft else 0  # a refused token would break the matcher
            for i in range(min(valid, n - 1)):
                matcher.consume((w.draft[i],))
                matcher.fill(bits[g + i + 1])
            if valid:
                matcher.rollback(min(valid, n - 1))
            g += n
        return Masks(tuple(rows), bits)

    def masks_beside(self, work: Sequence[Work]) -> concurrent.futures.Future | None:
        """`masks(work)` on a thread of its own, computed while the caller runs the pass's forward."""
        self.flush()
        if not self.wanted(work):
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lanes-masks")
        return self._pool.submit(self.masks, work)

    def advance(self, work: Sequence[Work], sampled: Sequence[Sampled | None]) -> None:
        """Each constrained lane's matcher takes the tokens its lane kept in the pass."""
        matchers = self._matchers
        if not matchers:
            return
        for w, s in zip(work, sampled):
            if s is not None:
                matcher = matchers.get(w.piece.lane)
                if matcher is not None:
                    matcher.consume(s.tokens)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def check_integrity(self) -> None:
        """Raises AssertionError unless the matchers are the bound lanes' (once the queued writes are made)."""
        self.flush()
        assert set(self._matchers) == self._bound, f"matchers {sorted(self._matchers)} != bound {sorted(self._bound)}"


def allowed(bits: np.ndarray, vocab: int) -> np.ndarray:
    """[W] int32 mask -> [vocab] bool, whether each token is allowed."""
    unpacked = np.unpackbits(bits.view(np.uint8), bitorder="little")
    return unpacked[:vocab].astype(bool)
