"""What an image's or a video's headers declare, read and checked before any pixel is decoded: sizes, the
frames sampling will take, and the memory decoding and preprocessing will hold at most (`cost`).

Plain sync functions for a worker thread. Costs are upper bounds measured on this stack (Pillow 13, av 18,
torch 2.13): each term names what holds the bytes; tests/test_media_costs.py checks them against the peak
resident memory of a process that decodes.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass

import av
import torch
from PIL import Image, UnidentifiedImageError

from lanes.vision.errors import MediaRejected
from lanes.vision.mp4_probe import probe_mp4

# 64 Mpx is above what cameras and phones write by default (<= 50 Mpx) and caps one RGB decode at 256 MiB.
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
IMAGE_FORMATS = frozenset({"JPEG", "MPO", "PNG"})
# Errors Pillow's parsers raise on bad data besides OSError (zlib, struct and chunk-size checks).
PILLOW_DATA_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error)
# Bytes a pixel takes in Pillow's memory by mode (every other mode Pillow reads from JPEG or PNG takes 4).
PILLOW_PIXEL_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2}
FIXED_COST = 16 << 20  # decoder state, row buffers and the interpreter's own churn, whatever the size


@dataclass(frozen=True)
class ImageHeader:
    width: int  # as stored; EXIF orientation may swap the two, which leaves the grid's patch count alone
    height: int
    mode: str  # Pillow's mode of the decoded pixels
    upright: bool  # known to need no EXIF transpose (a PNG's EXIF may come after its pixels: never known)


@dataclass(frozen=True)
class VideoHeader:
    """A probed mp4's first video stream as av opens it, before any frame is decoded."""

    data: bytes  # the probed bytes (only the video track's boxes): what decoding reads
    width: int
    height: int
    video_fps: float
    total_frames: int  # the container's count, or (fragmented) the fragments' declared samples
    counted: bool  # True when the container gives no count: decoding counts the frames first
    indices: tuple[int, ...]  # the frames sampling takes from `total_frames`


def open_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """A JPEG or PNG opened (header only), its pixel count checked against `max_pixels`.

    Raises `MediaRejected` (image_unreadable, image_format, image_too_large)."""
    try:
        image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaRejected("image_too_large") from None
    except (UnidentifiedImageError, *PILLOW_DATA_ERRORS):
        raise MediaRejected("image_unreadable") from None
    width, height = image.size
    if image.format not in IMAGE_FORMATS:
        image.close()
        raise MediaRejected("image_format")
    if width <= 0 or height <= 0:
        image.close()
        raise MediaRejected("image_unreadable")
    if width * height > max_pixels:
        image.close()
        raise MediaRejected("image_too_large")
    return image


def image_header(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> ImageHeader:
    """The image's size and mode from its header (the checks `decode_image` makes before decoding)."""
    with open_image(data, max_pixels) as image:
        upright = image.format != "PNG" and image.getexif().get(0x0112, 1) == 1
        return ImageHeader(image.width, image.height, image.mode, upright)


def image_cost(header: ImageHeader, resized: tuple[int, int]) -> int:
    """Bytes `decode_image` then `preprocess_image` may hold at once, the image resized to `resized` (h, w)."""
    pixels = header.width * header.height
    decoded = PILLOW_PIXEL_BYTES.get(header.mode, 4) * pixels
    rotated = 0 if header.upright else decoded  # an EXIF transpose holds the old pixels and the new
    rgb = 0 if header.mode == "RGB" else 4 * pixels  # Pillow's RGB takes 4 bytes a pixel
    resampled = 4 * max(header.height * resized[1], resized[0] * header.width)  # the resize's first pass
    preprocessed = 96 * resized[0] * resized[1]  # uint8, float64 and float32 copies, then the patches
    return decoded + rotated + rgb + resampled + preprocessed + FIXED_COST


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


@dataclass(frozen=True)
class Sampling:
    """How frames are sampled and bounded (Qwen2-VL's processor settings and the server's limits)."""

    fps: float = 2.0
    min_frames: int = MIN_FRAMES
    max_frames: int = MAX_FRAMES
    temporal_patch_size: int = 2
    max_pixels: int = MAX_FRAME_PIXELS
    max_total_frames: int = MAX_TOTAL_FRAMES
    max_sampled_pixels: int = MAX_SAMPLED_PIXELS

    def indices(self, total_frames: int, video_fps: float, width: int, height: int) -> tuple[int, ...]:
        """The sampled frames, checked: video_too_long, video_too_short, video_too_large."""
        if total_frames > self.max_total_frames:
            raise MediaRejected("video_too_long")
        if total_frames <= 0:
            raise MediaRejected("video_too_short")
        indices = sample_frame_indices(total_frames, video_fps, fps=self.fps, min_frames=self.min_frames,
                                       max_frames=self.max_frames, temporal_patch_size=self.temporal_patch_size)
        if len(indices) * width * height > self.max_sampled_pixels:
            raise MediaRejected("video_too_large")
        return indices


def open_video(data: bytes, max_pixels: int) -> av.container.InputContainer:
    """Probed mp4 bytes opened by the mp4 demuxer alone; its first video stream decodes frames of at most
    `max_pixels` (FFmpeg's own check, for a bitstream whose frames are larger than its sample entry says).

    Raises `MediaRejected` (video_no_stream, video_codec) and av's errors."""
    # stream_options reach the decoders FFmpeg opens to find the streams' parameters, inside av.open
    container = av.open(io.BytesIO(data), format="mp4", stream_options=[{"max_pixels": str(max_pixels)}])
    if not container.streams.video:
        container.close()
        raise MediaRejected("video_no_stream")
    context = container.streams.video[0].codec_context
    if context is None:
        container.close()
        raise MediaRejected("video_codec")  # FFmpeg knows no decoder for the sample entry
    context.options = {"max_pixels": str(max_pixels)}
    return container


def video_header(data: bytes, sampling: Sampling = Sampling()) -> VideoHeader:
    """The first video stream's size, rate, frame count and sampled frames, checked before any is decoded.

    Raises `MediaRejected` (video_unreadable, video_malformed, video_codec, video_no_stream,
    video_too_large, video_too_long, video_too_short)."""
    probe = probe_mp4(data, max_samples=sampling.max_total_frames, max_pixels=sampling.max_pixels)
    try:
        with open_video(probe.data, sampling.max_pixels) as container:
            stream = container.streams.video[0]
            width, height, rate, frames = stream.width, stream.height, stream.average_rate, stream.frames
    except MediaRejected:
        raise
    except (av.error.FFmpegError, OSError, ValueError):
        raise MediaRejected("video_unreadable") from None
    if width <= 0 or height <= 0 or rate is None or rate <= 0:
        raise MediaRejected("video_unreadable")
    if width * height > sampling.max_pixels:
        raise MediaRejected("video_too_large")
    total = frames if frames > 0 else probe.samples
    indices = sampling.indices(total, float(rate), width, height)
    return VideoHeader(probe.data, width, height, float(rate), total, frames <= 0, indices)


def video_cost(header: VideoHeader, resized: tuple[int, int]) -> int:
    """Bytes `decode_video` then `preprocess_video` may hold at once, each frame resized to `resized` (h, w)."""
    pixels = header.width * header.height
    frames = len(header.indices)
    decoder = 64 * pixels  # FFmpeg's reference frames and its threads' buffers (h264 at 720p: ~53 a pixel)
    sampled = 3 * pixels * (frames + 1)  # the rgb24 frames kept, and the one being converted
    resampled = 3 * frames * header.height * resized[1]  # the resize's first pass: as tall as the source
    preprocessed = 32 * frames * resized[0] * resized[1]  # the resized uint8 frames, float32 copies, the patches
    return decoder + sampled + resampled + preprocessed + FIXED_COST


def header_cost(data: bytes, kind: str) -> int:
    """Bytes reading a part's headers may hold: Pillow's header; or the probe's copies of an mp4 and the frames
    FFmpeg decodes inside av.open to find the stream's parameters (at most MAX_FRAME_PIXELS each: 4K took 29 MiB)."""
    if kind == "image":
        return len(data) + FIXED_COST
    return 3 * len(data) + 8 * MAX_FRAME_PIXELS + FIXED_COST
