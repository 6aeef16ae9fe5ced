"""Bytes to pixels: JPEG and PNG with Pillow, mp4 with av; plain sync functions for a worker thread."""

import io
import math
import struct
from dataclasses import dataclass

import av
import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from lanes.vision.errors import MediaRejected
from lanes.vision.mp4_probe import probe_mp4

# 64 Mpx is above what cameras and phones write by default (<= 50 Mpx) and caps one RGB decode at 192 MiB.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# One 4K UHD frame: larger frames are refused before any is decoded.
MAX_FRAME_PIXELS = 3840 * 2160
# Ten minutes at 30 fps: sampling decodes every frame up to the last one taken.
MAX_TOTAL_FRAMES = 18_000
# The sampled frames are held at once: 2**29 px is ~1.5 GiB of RGB, about 2 min of 1080p at 2 fps.
MAX_SAMPLED_PIXELS = 2**29
# Qwen2-VL's video processor: at least 4 frames, at most 768, counts a multiple of temporal_patch_size.
MIN_FRAMES = 4
MAX_FRAMES = 768

# Pillow calls a JPEG with a multi-picture extension (many phone photos) MPO; it is still a JPEG.
_IMAGE_FORMATS = frozenset({"JPEG", "MPO", "PNG"})
# Errors Pillow's parsers raise on bad data besides OSError (zlib, struct and chunk-size checks).
_PILLOW_DATA_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' `convert_to_rgb` makes it: any transparency composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def decode_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """A JPEG or PNG as a fully loaded RGB image, upright by its EXIF orientation, alpha over white.

    The pixel count in the header is checked against `max_pixels` before any pixel is decoded.
    Raises `MediaRejected` (image_unreadable, image_format, image_too_large, image_truncated).
    """
    try:
        image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaRejected("image_too_large") from None
    except (UnidentifiedImageError, *_PILLOW_DATA_ERRORS):
        raise MediaRejected("image_unreadable") from None
    with image:
        if image.format not in _IMAGE_FORMATS:
            raise MediaRejected("image_format")
        width, height = image.size
        if width <= 0 or height <= 0:
            raise MediaRejected("image_unreadable")
        if width * height > max_pixels:
            raise MediaRejected("image_too_large")
        try:
            image.load()
            upright = ImageOps.exif_transpose(image)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise MediaRejected("image_too_large") from None
        except _PILLOW_DATA_ERRORS:
            raise MediaRejected("image_truncated") from None
    return to_rgb(upright)


@dataclass(frozen=True, eq=False)
class VideoFrames:
    """Frames sampled from a video, in order, with what the Qwen processors need to know of them."""

    frames: np.ndarray  # [T, H, W, 3] uint8 RGB
    indices: tuple[int, ...]  # which decoded frames these are, ascending
    total_frames: int
    video_fps: float

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the samples (transformers' `VideoMetadata.sampled_fps`)."""
        return len(self.indices) / self.total_frames * self.video_fps


def sample_frame_indices(
    total_frames: int,
    video_fps: float,
    *,
    fps: float = 2.0,
    min_frames: int = MIN_FRAMES,
    max_frames: int = MAX_FRAMES,
    temporal_patch_size: int = 2,
) -> tuple[int, ...]:
    """Which frames Qwen2-VL's video processor takes (`Qwen2VLVideoProcessor.sample_frames` with fps).

    `fps` a second of the clip, clamped to [min_frames, max_frames] and to the clip, floored to a
    multiple of `temporal_patch_size`, spread evenly from frame 0: transformers' indices less any
    past the last frame. Raises `MediaRejected` (video_too_short) when that leaves no frame.
    """
    max_frames = math.floor(min(max_frames, total_frames) / temporal_patch_size) * temporal_patch_size
    num_frames = total_frames / video_fps * fps
    num_frames = min(max(num_frames, min_frames), max_frames, total_frames)
    num_frames = math.floor(num_frames / temporal_patch_size) * temporal_patch_size
    if num_frames <= 0:
        raise MediaRejected("video_too_short")
    # transformers' own expression: a float32 arange truncated, so the same indices come out
    indices = torch.arange(0, total_frames, total_frames / num_frames, dtype=torch.float32).int()
    # arange's length rounding can add index total_frames, which no frame has and transformers never gets
    return tuple(i for i in indices.tolist() if i < total_frames)


def decode_video(
    data: bytes,
    *,
    fps: float = 2.0,
    min_frames: int = MIN_FRAMES,
    max_frames: int = MAX_FRAMES,
    temporal_patch_size: int = 2,
    max_pixels: int = MAX_FRAME_PIXELS,
    max_total_frames: int = MAX_TOTAL_FRAMES,
    max_sampled_pixels: int = MAX_SAMPLED_PIXELS,
) -> VideoFrames:
    """An mp4's first video stream, sampled as transformers samples it (see `sample_frame_indices`).

    Frames are those transformers' pyav reader takes for the same indices: decoded in order from
    the start, converted to rgb24. The boxes are probed before FFmpeg reads any (`probe_mp4`), and
    sizes and counts are checked before frames are converted.
    Raises `MediaRejected` (video_unreadable, video_malformed, video_codec, video_no_stream,
    video_too_large, video_too_long, video_too_short).
    """
    probe = probe_mp4(data, max_samples=max_total_frames, max_pixels=max_pixels)
    try:
        container = open_video(probe.data, max_pixels)
    except (av.error.FFmpegError, OSError, ValueError):
        raise MediaRejected("video_unreadable") from None
    with container:
        stream = container.streams.video[0]
        width, height = stream.width, stream.height
        if width <= 0 or height <= 0:
            raise MediaRejected("video_unreadable")
        if width * height > max_pixels:
            raise MediaRejected("video_too_large")
        if stream.average_rate is None or stream.average_rate <= 0:
            raise MediaRejected("video_unreadable")
        video_fps = float(stream.average_rate)
        try:
            total = stream.frames if stream.frames > 0 else _count_frames(probe.data, max_pixels, max_total_frames)
        except (av.error.FFmpegError, OSError, ValueError):
            raise MediaRejected("video_unreadable") from None
        if total > max_total_frames:
            raise MediaRejected("video_too_long")
        if total <= 0:
            raise MediaRejected("video_too_short")
        indices = sample_frame_indices(
            total,
            video_fps,
            fps=fps,
            min_frames=min_frames,
            max_frames=max_frames,
            temporal_patch_size=temporal_patch_size,
        )
        if len(indices) * width * height > max_sampled_pixels:
            raise MediaRejected("video_too_large")
        try:
            frames, taken = _collect(container, stream, indices, (height, width))
        except (av.error.FFmpegError, OSError, ValueError):
            raise MediaRejected("video_unreadable") from None
    if not frames:
        raise MediaRejected("video_too_short")
    return VideoFrames(
        frames=np.stack(frames),  # [T, H, W, 3] uint8
        indices=taken,
        total_frames=total,
        video_fps=video_fps,
    )


def open_video(data: bytes, max_pixels: int) -> av.container.InputContainer:
    """Probed mp4 bytes opened by the mp4 demuxer alone; its first video stream decodes frames of at most
    `max_pixels` (FFmpeg's own check, for a bitstream whose frames are larger than its sample entry says).

    Raises `MediaRejected` (video_no_stream, video_codec) and av's errors."""
    container = av.open(io.BytesIO(data), format="mp4")
    if not container.streams.video:
        container.close()
        raise MediaRejected("video_no_stream")
    context = container.streams.video[0].codec_context
    if context is None:
        container.close()
        raise MediaRejected("video_codec")  # FFmpeg knows no decoder for the sample entry
    context.options = {"max_pixels": str(max_pixels)}
    return container


def _count_frames(data: bytes, max_pixels: int, limit: int) -> int:
    """Decoded frames of a stream whose header has no count (fragmented mp4), stopping past `limit`.

    A container of its own: decoding again after a seek could hand back frames of a decoder not yet flushed."""
    count = 0
    with open_video(data, max_pixels) as container:
        for _ in container.decode(container.streams.video[0]):
            count += 1
            if count > limit:
                break
    return count


def _collect(
    container: av.container.InputContainer,
    stream: av.VideoStream,
    indices: tuple[int, ...],
    shape: tuple[int, int],
) -> tuple[list[np.ndarray], tuple[int, ...]]:
    """The frames at `indices` as rgb24 arrays, decoding in order from the start as transformers does."""
    wanted = set(indices)
    frames: list[np.ndarray] = []
    taken: list[int] = []
    for i, frame in enumerate(container.decode(stream)):
        if i > indices[-1]:
            break
        if i not in wanted:
            continue
        # a stream may change size midway; the processors stack frames of one size
        if (frame.height, frame.width) != shape:
            raise MediaRejected("video_unreadable")
        frames.append(frame.to_ndarray(format="rgb24"))  # [H, W, 3] uint8
        taken.append(i)
    return frames, tuple(taken)
