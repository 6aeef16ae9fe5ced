"""Suffix drafts (`--draft suffix`), in the spirit of Arctic's suffix decoding: the stream's next tokens guessed
from what followed its latest tokens, in its own prompt and output and in the recent outputs of every
stream the server has finished.

An index maps each run of up to `depth` tokens to how often each token followed it. A draft starts from the
longest run at the stream's end that either index (the stream's own, or the server's) has seen, and grows a
token at a time, each the likeliest follower of the run it extends, while the draft's running likelihood
(the product of each token's share of its run's followers) stays above `floor`: an often-repeated pattern
drafts long, an uncertain one short or not at all. The server's index keeps `budget` tokens of outputs and
lets the oldest go. At most `STEP` positions of a stream are indexed a draft, so a long prompt is taken
in over a few passes, never in one stall.
"""


from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field


STEP = 512  # positions of a stream indexed a draft at most

class SuffixIndex:
    """Follower counts of every run of 1..`depth` tokens in the sequences added (and not yet removed)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.followers: dict[tuple[int, ...], Counter] = {}

    def add(self, tokens: list[int], start: int = 0) -> None:
        """Count the followers at positions `start`.. of `tokens` (earlier positions were added before)."""
        for position in range(max(start, 1), len(tokens)):
            follower = tokens[position]
            for n in range(1, min(self.depth, position) + 1):
                run = tuple(tokens[position - n:position])
                counts = self.followers.get(run)
                if counts is None:
                    counts = self.followers[run] = Counter()
                counts[follower] += 1

    def remove(self, tokens: list[int]) -> None:
        """Undo `add(tokens)`."""
        for position in range(1, len(tokens)):
            follower = tokens[position]
            for n in range(1, min(self.depth, position) + 1):
                run = tuple(tokens[position - n:position])
                counts = self.followers[run]
                counts[follower] -= 1
                if counts[follower] == 0:
                    del counts[follower]
                    if not counts:
                        del self.followers[run]


@dataclass
class _Stream:
    tokens: list[int]
    index: SuffixIndex
    added: int = 0  # positions of `tokens` whose followers are counted
    out: int = 0  # where its output starts (its prompt's length)


@dataclass
class SuffixDrafter:
    depth: int = 8  # the longest run looked up
    floor: float = 0.1  # a draft grows while its running likelihood stays above this
    budget: int = 200_000  # tokens of finished outputs the server's index keeps
    _streams: dict[int, _Stream] = field(default_factory=dict)
    _shared: SuffixIndex | None = None
    _kept: deque = field(default_factory=deque)  # the outputs in the server's index, oldest first
    _kept_tokens: int = 0

    def __post_init__(self) -> None:
        self._shared = SuffixIndex(self.depth)

    def propose(self, job, most: int) -> tuple[int, ...]:
        return self.peek(job, (), most)

    def peek(self, job, after: Sequence[int], most: int) -> tuple[int, ...]:
        """What `propose` gives once `after` (tokens drawn, not yet the stream's) follows the context, from
        the follower counts without `after`'s own (close: only load control reads a peek)."""
        stream = self._streams.get(job.id)
        if stream is None:
            stream = self._streams[job.id] = _Stream(list(job.prompt), SuffixIndex(self.depth), out=len(job.prompt))
        tokens = stream.tokens
        tokens.extend(job.generated[len(tokens) - len(job.prompt):])
        upto = min(len(tokens), stream.added + STEP)
        stream.index.add(tokens[:upto], stream.added)
        stream.added = upto
        context = (tokens[-self.depth:] + list(after))[-self.depth:] if after else tokens[-self.depth:]
        draft: list[int] = []
        likelihood = 1.0
        while len(draft) < most:
            best = self._follower(context, stream.index)
            if best is None:
                break
            token, share = best
            likelihood *= share
            if likelihood < self.floor:
                break
            draft.append(token)
            context = (context + [token])[-self.depth:]
        return tuple(draft)

    def _follower(self, context: list[int], own: SuffixIndex) -> tuple[int, float] | None:
        """The likeliest follower of the longest run at the context's end that an index has seen, and its
        share of that run's followers (the stream's own index first, at equal length)."""
        for n in range(len(context), 0, -1):
            run = tuple(context[-n:])
            for index in (own, self._shared):
                counts = index.followers.get(run)
                if counts:
                    token, count = counts.most_common(1)[0]
                    return token, count / sum(counts.values())
        return None

    def forget(self, job) -> None:
        """A finished stream's output joins the server's index; the oldest outputs leave it past the budget."""
        stream = self._streams.pop(job.id, None)
        if stream is None:
            return
        output = stream.tokens[stream.out:]
        if len(output) < 2:
            return
        self._shared.add(output)
        self._kept.append(output)
        self._kept_tokens += len(output)
        while self._kept_tokens > self.budget:
            oldest = self._kept.popleft()
            self._shared.remove(oldest)
            self._kept_tokens -= len(oldest)
