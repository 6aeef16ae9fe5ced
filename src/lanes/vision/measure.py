"""A part measured from its headers (its grid, the prompt rows it takes, what decoding it costs), then decoded
into a `Visual`: the two steps a request takes, plain sync functions for a worker thread.

Measuring reads no pixel, so a request can be refused on its rows or its cost before any part is decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lanes.vision.decode import decode_frames, decode_image
from lanes.vision.headers import (
    ImageHeader,
    Sampling,
    VideoHeader,
    image_cost,
    image_header,
    video_cost,
    video_header,
)
from lanes.vision.qwen_image import VisionParams, Visual, preprocess_image, preprocess_video, smart_resize

Kind = Literal["image", "video"]


@dataclass(frozen=True, eq=False)
class Measured:
    """One part's facts before decoding: what it will take in the prompt and in memory."""

    kind: Kind
    data: bytes  # what decoding reads (a video's probed bytes)
    header: ImageHeader | VideoHeader
    grid: tuple[int, int, int]  # (t, h, w) in patches, as preprocessing will make it
    tokens: int  # placeholder rows in the prompt
    cost: int  # bytes decoding and preprocessing may hold at once


def measure_image(data: bytes, params: VisionParams) -> Measured:
    """Raises `MediaRejected` (image_unreadable, image_format, image_too_large, image_aspect_ratio)."""
    header = image_header(data)
    resized = smart_resize(header.height, header.width, params, kind="image")
    return _measured("image", data, header, resized, 1, params, image_cost(header, resized))


def measure_video(data: bytes, params: VisionParams, sampling: Sampling) -> Measured:
    """Raises what `video_header` raises, and video_aspect_ratio."""
    header = video_header(data, sampling)
    resized = smart_resize(header.height, header.width, params, kind="video")
    return _measured("video", header.data, header, resized, len(header.indices), params, video_cost(header, resized))


def _measured(kind: Kind, data: bytes, header, resized: tuple[int, int], frames: int, params: VisionParams,
              cost: int) -> Measured:
    # an image is a clip of temporal_patch_size copies of itself; a clip is padded to a multiple of it
    grid = (-(-frames // params.temporal_patch_size), resized[0] // params.patch_size, resized[1] // params.patch_size)
    return Measured(kind, data, header, grid, grid[0] * grid[1] * grid[2] // params.merge_size**2, cost)


def decode_measured(measured: Measured, params: VisionParams, sampling: Sampling) -> Visual:
    """The part's pixels, preprocessed. Raises `MediaRejected` (image_truncated, video_unreadable, ...)."""
    if measured.kind == "image":
        return preprocess_image(decode_image(measured.data), params)
    return preprocess_video(decode_frames(measured.header, sampling).frames, params)
