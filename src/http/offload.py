"""Work whose cost grows with a request's text (a chat template's rendering, tokenizing) moved off the event
loop past a size, so that one huge prompt does not hold up every other stream's deliveries."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any, Callable, TypeVar

import trio

OFF_LOOP_CHARS = 16 << 10  # characters of text past which tokenizing runs in a worker thread
T = TypeVar("T")


def text_size(value: Any) -> int:
    """Characters of the strings in `value` (messages, tools, template variables), dict keys left out."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(text_size(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_size(item) for item in value)
    return 0


async def sized(size: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, in a worker thread when `size` (its text's characters) is past OFF_LOOP_CHARS.
    The tokenizer lets go of the GIL for long texts (`encode_ids`); a template renders in Python, which
    the interpreter interleaves with the loop."""
    if size < OFF_LOOP_CHARS:
        return fn(*args, **kwargs)
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs))
