"""The lane core's mailbox: the commands handlers send, and the one-shot replies they await."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import trio

from .blocks import IntegrityError
from .stream import EngineError, Request


class WarmCancelled(EngineError):
    """A warm pass yielded to a newer request (or to shutdown) before it finished."""

    def __init__(self) -> None:
        super().__init__("the warm pass yielded to a newer request")


@dataclass(frozen=True)
class WarmResult:
    """A finished warm pass: the prompt's full blocks' tokens, and whether the prompt cache kept them."""

    tokens: tuple[int, ...]
    kept: bool


class Reply:
    """A one-shot answer. Set by the lane core's inbox or pass loop; awaited by the one handler that asked."""

    def __init__(self) -> None:
        self._done = trio.Event()  # set by the lane core once, with a value or an error
        self.value: Any = None
        self.error: Exception | None = None
        self.delivered = False

    def set(self, value: Any) -> None:
        self._once()
        self.value = value
        self._done.set()

    def fail(self, error: Exception) -> None:
        self._once()
        self.error = error
        self._done.set()

    def _once(self) -> None:
        if self._done.is_set():
            raise IntegrityError("a reply answered twice")

    async def wait(self) -> Any:
        await self._done.wait()
        if self.error is not None:
            raise self.error
        self.delivered = True
        return self.value


@dataclass(frozen=True)
class Submit:
    request: Request
    reply: Reply = field(compare=False)


@dataclass(frozen=True)
class Cancel:
    stream_id: int


@dataclass(frozen=True)
class Warm:
    prompt: tuple[int, ...]
    reply: Reply = field(compare=False)


@dataclass(frozen=True)
class Resume:
    """A paused stream's consumer has read its buffer down: it gets rows again."""

    stream_id: int


@dataclass(frozen=True)
class Shutdown:
    grace: float


@dataclass(frozen=True)
class Decide:
    request: object  # a DecisionRequest
    reply: Reply = field(compare=False)
    key: object = field(compare=False, default=None)  # the asker's handle, for cancellation


@dataclass(frozen=True)
class CancelDecision:
    key: object
