"""What the HTTP server and the application say to each other: a request read whole, a response to write,
the limits a connection lives by, and the application's side of the bargain (`App`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol


@dataclass(frozen=True)
class ServerLimits:
    """How long and how much a client may take; every wait of a connection has one of these bounds."""

    max_body: int = 4 << 20  # bytes of a request body (then 413)
    max_headers: int = 16 << 10  # bytes of a request's headers (then 431)
    body_timeout: float = 30.0  # seconds for a request's head and body to arrive once begun (then 408)
    idle_timeout: float = 30.0  # seconds a kept-alive connection may wait for its next request
    send_timeout: float = 30.0  # seconds a write may make no progress before the response is ended
    send_buffer: int | None = None  # the kernel's send buffer a connection (SO_SNDBUF); None: its autotuning
    graceful_timeout: float = 5.0  # seconds responses under way get once the server stops


@dataclass(frozen=True)
class HttpRequest:
    """A request whose body has been read to its end (the server reads it before any answer)."""

    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes = b""
    http_version: str = "1.1"


@dataclass
class HttpResponse:
    """A status and either the whole body or an async iterator of chunks (an event stream)."""

    status: int
    body: bytes | AsyncIterator[bytes] = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    # A streamed body that leaves its request's deadline to the server: (the status the log reports, the
    # last bytes written) once the deadline passes mid-stream. None: the body keeps the deadline itself.
    deadline_answer: tuple[int, bytes] | None = None

    @property
    def streamed(self) -> bool:
        return not isinstance(self.body, (bytes, bytearray))


class Exchange(Protocol):
    """One request's bookkeeping, opened by the application and finished by the server exactly once."""

    id: str
    deadline: float  # trio time past which no write of this response may happen (inf: none)
    status: int | None  # set by a streamed body that ended in an error event: what the log reports

    def finish(self, status: int) -> None: ...


class App(Protocol):
    def open(self, request: HttpRequest) -> Exchange:
        """The request's exchange (its id goes out as `x-request-id`)."""
        ...

    async def handle(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        """The answer; raising is a bug, answered 500 (or 503 when memory ran out)."""
        ...

    def refusal(self, status: int, exchange: Exchange | None) -> HttpResponse:
        """The answer to a request the server refused before the application saw it (400, 408, 413, 431),
        or to an application that failed (500, 503)."""
        ...

