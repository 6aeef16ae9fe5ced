"""A request's images and videos, from URLs to the PromptMedia the lane core carries.

Two steps, each off the event loop and cancelled with the request. `measure`: every part fetched (data
URLs always; HTTPS URLs with --vision-urls) and read from its headers alone: its grid, the rows it takes
and what decoding it costs, so a caller can refuse a request on its rows before any pixel is decoded.
`decode`: the parts decoded and preprocessed one at a time. Both reserve the server's decode gate
(memory and a worker slot, first come first served) for each part in turn, so another client's part never
waits behind a whole queue of this request's parts. The rendered prompt holds one placeholder token a part
(`<|image_pad|>` or `<|video_pad|>`, in the parts' order); `expand` repeats each as many times as its grid
has merged patches and notes where its rows are.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Literal, Sequence, TypeVar

import numpy as np
import trio

from ..core.media import PromptMedia
from ..families.qwen2_vl import VisionTokens
from ..vision.errors import MediaRejected
from ..vision.headers import Sampling, header_cost
from ..vision.measure import Measured, decode_measured, measure_image, measure_video
from ..vision.qwen_image import IMAGE_DEFAULTS, VIDEO_DEFAULTS, VisionParams, Visual
from . import errors
from .decode_gate import DecodeGate, GateStatistics
from .media_fetch import MediaFetcher, MediaPart, MediaRefused

Kind = Literal["image", "video"]
T = TypeVar("T")
MAX_PARTS = 16  # images and videos a request may carry (--max-media-parts)


@dataclass(frozen=True)
class Prepared:
    """One part, ready: its patches and grid, and a digest of both (what the prompt cache keys it by)."""

    visual: Visual
    digest: bytes
    interval: float  # positions between its temporal patches


@dataclass(frozen=True)
class VisionInputs:
    """What a server started with --vision holds to turn parts into media; `gate` is the server's one."""

    fetcher: MediaFetcher
    tokens: VisionTokens
    image: VisionParams = IMAGE_DEFAULTS
    video: VisionParams = VIDEO_DEFAULTS
    fps: float = 2.0  # video frames sampled a second, as transformers' Qwen2-VL processors do
    max_parts: int = MAX_PARTS
    gate: DecodeGate = field(default_factory=DecodeGate)

    @property
    def sampling(self) -> Sampling:
        return Sampling(fps=self.fps, temporal_patch_size=self.video.temporal_patch_size)

    async def measure(self, parts: Sequence[MediaPart]) -> list[Measured]:
        """Every part fetched (concurrently) and measured from its headers (one at a time); nothing decoded.

        Refusals are ApiErrors: too_many_media_parts (param unset) before anything is fetched, then the
        first part refused, under that part's param."""
        if len(parts) > self.max_parts:
            raise errors.too_many_media_parts(len(parts), self.max_parts)
        try:
            blobs = await self.fetcher.fetch_all(parts)
        except MediaRefused as refused:
            raise errors.media_refused(refused.code, refused.param) from None
        measured = []
        for part, blob in zip(parts, blobs):
            work = partial(self._measure, blob, part.kind)
            measured.append(await self._off_loop(work, header_cost(blob, part.kind), part.param))
        return measured

    async def decode(self, parts: Sequence[MediaPart], measured: Sequence[Measured]) -> list[Prepared]:
        """The measured parts decoded and preprocessed one at a time; the first refusal as an ApiError (a part
        costing more than the whole budget is refused before any part is decoded)."""
        for part, one in zip(parts, measured):
            if not self.gate.fits(one.cost):
                raise errors.media_refused("media_over_budget", part.param)
        prepared = []
        for part, one in zip(parts, measured):
            prepared.append(await self._off_loop(partial(self._prepare, one), one.cost, part.param))
        return prepared

    async def _off_loop(self, work: Callable[[], T], cost: int, param: str | None) -> T:
        if not self.gate.fits(cost):
            raise errors.media_refused("media_over_budget", param)
        async with self.gate.hold(cost):
            try:
                # never abandoned: the thread's memory is the gate's until the thread is done with it
                return await trio.to_thread.run_sync(work)
            except MediaRejected as rejected:
                code = rejected.code
        # raised outside the gate's block: contextlib cannot rewrite a frozen ApiError's traceback
        raise errors.media_refused(code, param)

    def _measure(self, data: bytes, kind: Kind) -> Measured:
        if kind == "image":
            return measure_image(data, self.image)
        return measure_video(data, self.video, self.sampling)

    def _prepare(self, measured: Measured) -> Prepared:
        params = self.image if measured.kind == "image" else self.video
        visual = decode_measured(measured, params, self.sampling)
        interval = 1.0
        per_second = self.tokens.tokens_per_second
        if measured.kind == "video" and per_second is not None:
            # Qwen2.5-VL: a temporal patch spans temporal_patch_size / fps seconds (transformers' second_per_grid_ts)
            interval = per_second * self.video.temporal_patch_size / self.fps
        pixels = visual.pixel_values.numpy()
        digest = hashlib.sha256(repr((measured.kind, visual.grid)).encode() + np.ascontiguousarray(pixels).tobytes()).digest()
        return Prepared(visual, digest, interval)

    def rows(self, prompt: Sequence[int], measured: Sequence[Measured]) -> int:
        """The prompt's length once every placeholder is expanded into its part's measured rows."""
        return len(prompt) - len(measured) + sum(m.tokens for m in measured)

    def check_placeholders(self, prompt: Sequence[int], kinds: Sequence[Kind]) -> None:
        """Placeholders and parts must agree in number and kind, in order (ApiError, param unset, otherwise)."""
        pads = {self.tokens.image: "image", self.tokens.video: "video"}
        found = [pads[t] for t in prompt if t in pads]
        if found != list(kinds):
            raise errors.media_placeholders(found.count("image"), found.count("video"), kinds.count("image"),
                                            kinds.count("video"), param=None)

    def expand(self, prompt: Sequence[int], prepared: Sequence[Prepared]) -> tuple[tuple[int, ...], tuple[PromptMedia, ...]]:
        """The prompt with each placeholder repeated for its part's rows, and the parts' PromptMedia.

        Placeholders and parts must agree in number and kind, in order (ApiError otherwise)."""
        self.check_placeholders(prompt, [p.visual.kind for p in prepared])
        pads = (self.tokens.image, self.tokens.video)
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

    def statistics(self) -> GateStatistics:
        return self.gate.statistics()
