"""Images and videos in a prompt, as the lane core carries them: placeholder rows, patches, digests.

The lane core never looks inside: it checks where the rows are, hands the media to the backend when the
stream takes a lane, and keys the prompt cache by the media's digests as well as the tokens, so that two
prompts alike but for their images never share a cached block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .sampling import InvalidParameter


@dataclass(frozen=True, eq=False)
class PromptMedia:
    """One image or video: its `rows` placeholder tokens from prompt row `start`, its patch grid (t, h, w,
    before the merge), its preprocessed patches (a host tensor the backend's vision tower reads), the
    positions between its temporal patches, and a digest of its pixels and grid (sha256)."""

    kind: str  # "image" or "video"
    start: int
    rows: int
    grid: tuple[int, int, int]
    pixels: object
    digest: bytes
    interval: float = 1.0

    @property
    def end(self) -> int:
        return self.start + self.rows


def check_media(prompt_length: int, media: Sequence[PromptMedia]) -> None:
    """Raises InvalidParameter unless the media's rows lie inside the prompt, in order, apart."""
    at = 0
    for item in media:
        if item.rows < 1 or item.start < at or item.end > prompt_length:
            raise InvalidParameter("messages", "image and video rows must lie inside the prompt, in order")
        at = item.end


def cache_key(prompt: Sequence[int], media: Sequence[PromptMedia]) -> tuple:
    """The prompt as the prompt cache keys it: its tokens, with each media row replaced by the media's whole
    digest and the row's index in it (exact values, never a short hash)."""
    if not media:
        return tuple(prompt)
    key: list = list(prompt)
    for item in media:
        key[item.start : item.end] = [(item.digest, i) for i in range(item.rows)]
    return tuple(key)
