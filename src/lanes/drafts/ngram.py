"""Prompt lookup (`--draft ngram`): a stream's next tokens guessed from its own prompt and output.

The longest of the stream's last n tokens (n from `longest` down to `shortest`) that occurred before in
its context proposes what followed its latest earlier occurrence. Each stream keeps an index of its
context's n-grams, grown by the tokens added since its last draft, so a draft costs a few lookups; at most
`STEP` positions are indexed a draft, so a long prompt is taken in over a few passes, never in one stall.
"""


from __future__ import annotations

from dataclasses import dataclass, field


STEP = 1024  # positions indexed a draft at most

@dataclass
class _Context:
    tokens: list[int]
    indexed: int = 0  # positions whose n-grams ending there are in `follows`
    follows: dict[tuple[int, ...], int] = field(default_factory=dict)  # an n-gram -> where its latest follower is


class NgramDrafter:
    def __init__(self, longest: int = 4, shortest: int = 2) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError("the n-grams' lengths must satisfy 1 <= shortest <= longest")
        self.longest, self.shortest = longest, shortest
        self._contexts: dict[int, _Context] = {}  # job id -> its context and index

    def propose(self, job, most: int) -> tuple[int, ...]:
        context = self._contexts.get(job.id)
        if context is None:
            context = self._contexts[job.id] = _Context(list(job.prompt))
        tokens = context.tokens
        tokens.extend(job.generated[len(tokens) - len(job.prompt):])
        last = len(tokens) - 1
        self._index(context, min(last, context.indexed + STEP))  # n-grams ending before the last token
        for n in range(min(self.longest, last + 1), self.shortest - 1, -1):
            start = context.follows.get(tuple(tokens[last - n + 1:]))
            if start is not None:
                return tuple(tokens[start:start + most])
        return ()

    def _index(self, context: _Context, end: int) -> None:
        tokens, follows = context.tokens, context.follows
        for position in range(context.indexed, end):
            for n in range(self.shortest, min(self.longest, position + 1) + 1):
                follows[tuple(tokens[position - n + 1:position + 1])] = position + 1
        context.indexed = max(context.indexed, end)

    def forget(self, job) -> None:
        self._contexts.pop(job.id, None)
