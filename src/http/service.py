"""What the HTTP handlers share: the actors they talk to and the server's fixed facts. No mutable state."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..core.lane_core import LaneCore
from ..text.tokenizer import Tokenizer
from .metrics import Metrics

MAX_BODY = 4 << 20


@dataclass
class Service:
    core: LaneCore
    tokenizer: Tokenizer
    model_name: str
    family: str
    max_model_len: int
    vocab_size: int = 0  # the model's (token ids up to it are valid prompts); 0: the tokenizer's
    request_timeout: float = 600.0
    api_key: str | None = None
    vision: bool = False
    decides: bool = False
    tp: int = 1
    max_body: int = MAX_BODY
    metrics: Metrics = field(default=None)  # type: ignore[assignment]
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("lanes.http"))

    def __post_init__(self) -> None:
        self.vocab_size = self.vocab_size or self.tokenizer.vocab_size
        if self.metrics is None:
            self.metrics = Metrics(self.core.statistics)

    def info(self) -> dict:
        stats = self.core.statistics()
        return {
            "model": self.model_name,
            "family": self.family,
            "lanes": stats.lanes,
            "lanes_busy": stats.lanes_busy,
            "max_rows": stats.max_rows,
            "tp": self.tp,
            "vision": self.vision,
            "decides": self.decides,
            "admission": {
                "max_queue": stats.max_queue,
                "queued": stats.queued,
                "max_model_len": self.max_model_len,
                "request_timeout": self.request_timeout,
                "max_body_bytes": self.max_body,
            },
            "kv_blocks": {"total": stats.blocks_total, "free": stats.blocks_free},
        }
