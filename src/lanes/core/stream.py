"""What a client hands the lane core and what it gets back: requests, stream events, typed errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from .events import EventChannel
from .sampling import SamplingParams

FinishReason = Literal["stop", "length", "cancelled"]


class EngineError(Exception):
    """An error the lane core answers a waiter with; the HTTP layer maps each kind to frozen words."""


class QueueFull(EngineError):
    """The admission queue is full: refused at once (429 with Retry-After)."""

    def __init__(self, queued: int) -> None:
        super().__init__(f"the admission queue is full ({queued} waiting)")
        self.queued = queued


class QueueTimeout(EngineError):
    """The request's deadline passed before a lane was free."""

    def __init__(self) -> None:
        super().__init__("no lane became free before the request's deadline")


class ShuttingDown(EngineError):
    """The engine is shutting down: no new work, and live work past the grace deadline ends with this."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down")


class EmptyPrompt(EngineError):
    """A stream's prompt has no tokens: there is no position to draw the first token at."""

    def __init__(self) -> None:
        super().__init__("the prompt is empty: a prompt needs at least one token")


class PromptTooLong(EngineError):
    """The prompt and the tokens asked for do not fit the model's length or the KV pool."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"the request needs {tokens} tokens of context, the limit is {limit}")
        self.tokens = tokens
        self.limit = limit


class BackendFailed(EngineError):
    """A pass failed on the device; every waiter gets this and the engine stops."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the model pass failed: {type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class Request:
    """A generation request: prompt token ids and how to sample; `deadline` (trio time) bounds the wait for a lane."""

    prompt: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    deadline: float = float("inf")
    media: tuple = ()  # PromptMedia: images and videos whose placeholder rows are in the prompt


@dataclass(frozen=True)
class TopLogprob:
    token: int
    logprob: float


@dataclass(frozen=True, init=False)
class TokenEvent:
    """One sampled token, the text it completes (possibly empty: held back or a partial character)."""

    token: int
    text: str
    logprob: float | None = None
    top: tuple[TopLogprob, ...] = ()

    def __init__(self, token: int, text: str, logprob: float | None = None, top: tuple[TopLogprob, ...] = ()) -> None:
        # One a token: the instance dict filled at once, where a frozen dataclass's own __init__ would call
        # object.__setattr__ for each field (three times slower).
        fields = self.__dict__
        fields["token"], fields["text"], fields["logprob"], fields["top"] = token, text, logprob, top


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of the prompt's tokens (the first has none), sent before any token when asked for."""

    logprobs: tuple[float | None, ...]
    top: tuple[tuple[TopLogprob, ...], ...]


@dataclass(frozen=True)
class Finished:
    """The last event of a stream that ended normally; `text` is held-back text released at the end."""

    reason: FinishReason
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache


@dataclass(frozen=True)
class Failed:
    """The last event of a stream that ended in an error."""

    error: EngineError


StreamEvent = TokenEvent | PromptLogprobs | Finished | Failed


@dataclass
class Stream:
    """The client's side of a stream: its engine-assigned id and the channel its events arrive on.

    Closing `events` (or leaving `async with stream`) tells the engine the consumer is gone: its lane and
    blocks are freed at the next pass boundary.
    """

    id: int
    events: EventChannel
    _cancel: Callable[[int], None] = field(repr=False)

    async def aclose(self) -> None:
        """The consumer is done: cancel the stream (idempotent) and close the channel."""
        try:
            self._cancel(self.id)
        except EngineError:
            pass  # the engine has stopped; the stream ended with it
        await self.events.aclose()

    async def __aenter__(self) -> "Stream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
