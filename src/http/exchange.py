"""One request's bookkeeping: its id, its deadline, the tokens it used, and its one log line and metrics,
written when the server has finished answering it (or seen its client leave)."""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .service import Service

CLIENT_ID = re.compile(r"[!-~]{1,128}")  # a client's x-request-id: printable ASCII, no spaces (one log line)


@dataclass
class Timing:
    """When the request started and when its tokens came (for the log line and the histograms)."""

    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)

    def token(self) -> None:
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.gaps.append(now - self.last_token)
        self.last_token = now

    def tokens(self, count: int) -> None:
        """`count` tokens that came together (the gaps between them are nothing)."""
        self.token()
        self.gaps.extend([0.0] * (count - 1))

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started


class Exchange:
    """Opened by the application when a request's head arrives; finished by the server exactly once with
    the status the client got (499 when it left or stopped reading before the end)."""

    def __init__(self, service: Service, endpoint: str, client_id: str | None = None) -> None:
        self.service, self.endpoint = service, endpoint
        self.id = client_id if client_id is not None and CLIENT_ID.fullmatch(client_id) else uuid.uuid4().hex[:24]
        self.deadline = math.inf  # trio time: set by handlers whose answers have one
        self.status: int | None = None  # set by a stream that ended in an error event
        self.timing = Timing()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self._done = False

    def finish(self, status: int) -> None:
        if self._done:
            return
        self._done = True
        m, t = self.service.metrics, self.timing
        total = time.perf_counter() - t.started
        m.requests.labels(self.endpoint, str(status)).inc()
        m.prompt_tokens.inc(self.prompt_tokens)
        m.completion_tokens.inc(self.completion_tokens)
        m.duration.observe(total)
        if t.ttft is not None:
            m.ttft.observe(t.ttft)
        m.inter_token.observe_all(t.gaps)
        ttft = "-" if t.ttft is None else f"{t.ttft:.3f}s"
        self.service.log.info("%s %s status=%d prompt=%d completion=%d ttft=%s total=%.3fs", self.id, self.endpoint,
                              status, self.prompt_tokens, self.completion_tokens, ttft, total)
