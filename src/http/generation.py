"""Running a request's n streams on the lane core: submit, collect or stream events, close on any exit.

A handler cancelled because its client went away closes its streams in a shielded `finally`, so the lane
core frees their lanes at the next pass boundary. Every wait is bounded by the request's deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Sequence

import trio

from ..core.sampling import SamplingParams
from ..core.stream import Failed, Finished, PromptLogprobs, Request, Stream, TokenEvent
from . import errors
from .exchange import Timing


@dataclass
class Choice:
    """One stream's result as it accumulates."""

    index: int
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenEvent] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, event) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token)
            self.text.append(event.text)
            self.logprobs.append(event)
        elif isinstance(event, PromptLogprobs):
            self.prompt_logprobs = event
        elif isinstance(event, Finished):
            self.text.append(event.text)
            self.finish_reason = "length" if event.reason == "length" else "stop"
            self.prompt_tokens = event.prompt_tokens
            self.cached_tokens = event.cached_tokens
        elif isinstance(event, Failed):
            raise errors.from_engine(event.error)


def sampling_for(sampling: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n streams: a given seed is offset by i so the n choices differ but stay reproducible."""
    return sampling if sampling.seed is None or index == 0 else replace(sampling, seed=sampling.seed + index)


async def open_streams(core, prompt: Sequence[int], sampling: SamplingParams, n: int, deadline: float,
                       media: Sequence = ()) -> list[Stream]:
    """Submit n streams; if any submit fails, the ones already open are closed before the error goes up."""
    streams: list[Stream] = []
    try:
        for i in range(n):
            streams.append(await core.submit(Request(tuple(prompt), sampling_for(sampling, i), deadline, tuple(media))))
    except BaseException:
        await close_all(streams)
        raise
    return streams


async def close_all(streams: Sequence[Stream]) -> None:
    with trio.CancelScope(shield=True):  # runs while the handler is being cancelled
        for stream in streams:
            await stream.aclose()


async def next_event(stream: Stream, deadline: float):
    """The stream's next event, or a deadline_exceeded refusal."""
    with trio.move_on_at(deadline):
        return await stream.events.receive()
    raise errors.deadline_exceeded()


async def collect(streams: Sequence[Stream], deadline: float, timing: Timing) -> list[Choice]:
    """Every stream's whole result (for a non-streaming response)."""
    choices = [Choice(i) for i in range(len(streams))]
    try:
        for stream, choice in zip(streams, choices):
            while choice.finish_reason is None:
                try:
                    event = await next_event(stream, deadline)
                except trio.EndOfChannel:
                    raise errors.internal() from None
                if isinstance(event, TokenEvent):
                    timing.token()
                choice.add(event)
    finally:
        await close_all(streams)
    return choices


async def batches(streams: Sequence[Stream], timing: Timing) -> AsyncIterator[list[tuple[int, object]]]:
    """Every (choice index, event) waiting across the streams, as one batch, once the first open stream has
    one: a consumer that fell behind takes its backlog in one go. No deadline of its own: the caller (the
    server, for a streamed answer) keeps the request's in one cancel scope.

    The caller owns the streams and closes them (`close_all`), as with `events`."""
    open_ = list(range(len(streams)))
    while open_:
        first = open_[0]
        try:
            batch = [(first, await streams[first].events.receive())]
        except trio.EndOfChannel:
            raise errors.internal() from None
        for index in open_:
            if index != first or not isinstance(batch[0][1], (Finished, Failed)):  # nothing follows a last event
                batch.extend((index, event) for event in streams[index].events.drain())
        tokens = 0
        for index, event in batch:
            if type(event) is TokenEvent:
                tokens += 1
            elif isinstance(event, (Finished, Failed)):
                open_.remove(index)
        if tokens:
            timing.tokens(tokens)
        yield batch


async def events(streams: Sequence[Stream], deadline: float, timing: Timing) -> AsyncIterator[tuple[int, object]]:
    """(choice index, event) as they come, round-robin over the streams, which advance in the same passes.

    The caller owns the streams and closes them (`close_all`) in its own `finally`: a generator that is
    dropped mid-way runs its `finally` only when collected.
    """
    open_ = list(range(len(streams)))
    while open_:
        for index in list(open_):
            try:
                event = await next_event(streams[index], deadline)
            except trio.EndOfChannel:
                raise errors.internal() from None
            if isinstance(event, TokenEvent):
                timing.token()
            if isinstance(event, (Finished, Failed)):
                open_.remove(index)
            yield index, event
