"""What the HTTP handlers share: the actors they talk to and the server's fixed facts. No mutable state."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..core.lane_core import LaneCore
from ..core.metered import PassTimes
from ..grammar.engine import GrammarEngine
from ..text.tokenizer import Tokenizer
from .metrics import Metrics
from .protocol import ServerLimits
from ..tools.formats import ToolFormat, choose
from ..tools.prompting import TemplateTools
from .response_store import ResponseStore
from .tool_system import ToolSystem

if TYPE_CHECKING:
    from .vision_inputs import VisionInputs

MAX_BODY = 4 << 20
MAX_HEADERS = 16 << 10


class OpenRequests:
    """How many generation and decision requests are open (a streaming one until its stream ends)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0

    def try_enter(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1


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
    vision_inputs: "VisionInputs | None" = None  # with --vision: how parts become media
    decides: bool = False
    tp: int = 1
    max_body: int = MAX_BODY
    max_headers: int = MAX_HEADERS
    body_timeout: float = 30.0
    send_timeout: float = 30.0  # a write that makes no progress this long ends its response
    idle_timeout: float = 30.0  # a kept-alive connection waits this long for its next request
    send_buffer: int | None = None  # SO_SNDBUF of each connection (None: the kernel sizes it)
    max_open: int = 1024
    stream_writers: int = 0  # processes that write streamed answers to their sockets (0: the event loop writes)
    tool_system: "ToolSystem | None" = None
    followers: object = None  # rank 0's Followers when there are ranks above 0
    decision_timeout: float = 30.0
    label_tokens: dict | str | None = None  # found at the first decision: each label set's tokens, or why not
    pass_times: Callable[[], PassTimes] | None = None  # the backend's pass times (a MeteredBackend's), for /metrics
    draft_method: str | None = None  # --draft's method (ngram, suffix) or "model"; None: no drafts
    draft_tokens: int = 0  # a lane's most draft tokens a pass (--draft-tokens, or this device's default)
    grammars: GrammarEngine | None = None  # constrained decoding (response_format, tool choices); None refuses it
    kv_cache: dict | None = None  # the KV cache's dtype and bytes (`KVCache.describe`); None: no device cache (the fake)
    weights: dict | None = None  # the weights' types (counts and bytes by type) and resident bytes, rank 0's shard
    max_responses: int = 1024  # /v1/responses kept in memory for previous_response_id, the newest
    metrics: Metrics = field(default=None)  # type: ignore[assignment]
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("lanes.http"))

    def __post_init__(self) -> None:
        self.vocab_size = self.vocab_size or self.tokenizer.vocab_size
        self.open_requests = OpenRequests(self.max_open)
        self.created = int(time.time())  # when this server started serving its model (/v1/models)
        template = self.tokenizer.chat_template
        self.tool_format: ToolFormat = choose(template.source if template is not None else None)
        self.template_tools = TemplateTools.probe(template)  # what the template renders of tools itself
        self.responses = ResponseStore(self.max_responses)
        if self.metrics is None:
            self.metrics = Metrics(self.model_name, self.core.statistics,
                                   lambda: (self.tp, self.followers.statistics() if self.followers else None),
                                   self.pass_times)

    @property
    def limits(self) -> ServerLimits:
        return ServerLimits(max_body=self.max_body, max_headers=self.max_headers, body_timeout=self.body_timeout,
                            idle_timeout=self.idle_timeout, send_timeout=self.send_timeout,
                            send_buffer=self.send_buffer)

    def model_card(self) -> dict:
        """The served model as /v1/models lists it."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lanes",
                "max_model_len": self.max_model_len}

    def context_room(self) -> int:
        """The most tokens a stream may span: the model's length, or the whole KV pool if that is less."""
        return self.core.context_room

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
            "media": self._media_info(),
            "decides": self.decides,
            "admission": {
                "max_queue": stats.max_queue,
                "queued": stats.queued,
                "max_model_len": self.max_model_len,
                "request_timeout": self.request_timeout,
                "max_body_bytes": self.max_body,
                "max_header_bytes": self.max_headers,
                "max_open_requests": self.max_open,
                "open_requests": self.open_requests.open,
                "send_timeout": self.send_timeout,
                "stream_writers": self.stream_writers,
            },
            "kv_blocks": {"total": stats.blocks_total, "free": stats.blocks_free},
            "kv_cache": self.kv_cache,
            "weights": self.weights,
            "prompt_cache": self._cache_info(stats.cache),
            "drafts": self._drafts_info(stats.drafts),
            "tool_system": self.tool_system is not None,
            "followers": self._followers_info(),
        }

    def _media_info(self) -> dict | None:
        if self.vision_inputs is None:
            return None
        g = self.vision_inputs.statistics()
        return {"max_parts": self.vision_inputs.max_parts, "decode_budget_bytes": g.budget_bytes,
                "decode_slots": g.slots, "decode_held_bytes": g.held_bytes, "decoding": g.running, "waiting": g.waiting}

    def _followers_info(self) -> dict | None:
        if self.followers is None:
            return None
        f = self.followers.statistics()
        return {"world": f.world, "state": f.state, "plans": f.plans, "heartbeats": f.heartbeats}

    def _drafts_info(self, d) -> dict | None:
        if d is None:
            return None
        return {"method": self.draft_method, "most_tokens": self.draft_tokens, "drafted": d.drafted,
                "accepted": d.accepted, "pieces": d.pieces, "mean_accepted_length": d.mean_accepted}

    @staticmethod
    def _cache_info(c) -> dict | None:
        if c is None:
            return None
        return {"held_bytes": c.held_bytes, "budget_bytes": c.budget_bytes, "entries": c.entries, "hits": c.hits,
                "misses": c.misses}
