"""A request's images and videos, from URLs to the PromptMedia the lane core carries.

Each part is fetched (data URLs always; HTTPS URLs with --vision-urls), decoded and preprocessed off the
event loop, all parts of a request at once, cancelled with it. The rendered prompt holds one placeholder
token a part (`<|image_pad|>` or `<|video_pad|>`, in the parts' order); `expand` repeats each as many times
as its grid has merged patches and notes where its rows are.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial
from typing import Literal, Sequence

import numpy as np
import trio

from ..core.media import PromptMedia
from ..families.qwen2_vl import VisionTokens
from ..vision.decode import decode_image, decode_video
from ..vision.errors import MediaRejected
from ..vision.qwen_image import IMAGE_DEFAULTS, VIDEO_DEFAULTS, VisionParams, Visual, preprocess_image, preprocess_video
from . import errors
from .media_fetch import MediaFetcher, MediaPart, MediaRefused

Kind = Literal["image", "video"]


@dataclass(frozen=True)
class Prepared:
    """One part, ready: its patches and grid, and a digest of both (what the prompt cache keys it by)."""

    visual: Visual
    digest: bytes
    interval: float  # positions between its temporal patches


@dataclass(frozen=True)
class VisionInputs:
    """What a server started with --vision holds to turn parts into media."""

    fetcher: MediaFetcher
    tokens: VisionTokens
    image: VisionParams = IMAGE_DEFAULTS
    video: VisionParams = VIDEO_DEFAULTS
    fps: float = 2.0  # video frames sampled a second, as transformers' Qwen2-VL processors do

    async def prepare(self, parts: Sequence[MediaPart]) -> list[Prepared]:
        """Every part fetched, decoded and preprocessed, concurrently; the first refusal as an ApiError."""
        try:
            blobs = await self.fetcher.fetch_all(parts)
        except MediaRefused as refused:
            raise errors.media_refused(refused.code, refused.param) from None
        out: list[Prepared | None] = [None] * len(parts)
        failure: list[errors.ApiError] = []

        async def one(i: int) -> None:
            try:
                out[i] = await trio.to_thread.run_sync(partial(self._prepare, blobs[i], parts[i].kind), abandon_on_cancel=True)
            except MediaRejected as rejected:
                failure.append(errors.media_refused(rejected.code, parts[i].param))
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for i in range(len(parts)):
                nursery.start_soon(one, i)
        if failure:
            raise failure[0]
        return out  # type: ignore[return-value]

    def _prepare(self, data: bytes, kind: Kind) -> Prepared:
        if kind == "image":
            visual = preprocess_image(decode_image(data), self.image)
            interval = 1.0
        else:
            frames = decode_video(data, fps=self.fps, temporal_patch_size=self.video.temporal_patch_size)
            visual = preprocess_video(frames.frames, self.video)
            # Qwen2.5-VL: a temporal patch spans temporal_patch_size / fps seconds (transformers' second_per_grid_ts)
            per_second = self.tokens.tokens_per_second
            interval = 1.0 if per_second is None else per_second * self.video.temporal_patch_size / self.fps
        pixels = visual.pixel_values.numpy()
        digest = hashlib.sha256(repr((kind, visual.grid)).encode() + np.ascontiguousarray(pixels).tobytes()).digest()
        return Prepared(visual, digest, interval)

    def expand(self, prompt: Sequence[int], prepared: Sequence[Prepared]) -> tuple[tuple[int, ...], tuple[PromptMedia, ...]]:
        """The prompt with each placeholder repeated for its part's rows, and the parts' PromptMedia.

        Placeholders and parts must agree in number and kind, in order (ApiError otherwise)."""
        pads = {self.tokens.image: "image", self.tokens.video: "video"}
        found = [pads[t] for t in prompt if t in pads]
        if found != [p.visual.kind for p in prepared]:
            raise errors.media_placeholders(found.count("image"), found.count("video"),
                                            sum(p.visual.kind == "image" for p in prepared),
                                            sum(p.visual.kind == "video" for p in prepared))
        out: list[int] = []
        media: list[PromptMedia] = []
        parts = iter(prepared)
        for token in prompt:
            if token not in pads:
                out.append(token)
                continue
            part = next(parts)
            visual = part.visual
            media.append(PromptMedia(visual.kind, len(out), visual.tokens, visual.grid, visual.pixel_values,
                                     part.digest, part.interval))
            out.extend([token] * visual.tokens)
        return tuple(out), tuple(media)
