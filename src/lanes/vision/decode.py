"""Bytes to pixels: JPEG and PNG with Pillow, mp4 with av; plain sync functions for a worker thread.

Headers are read and checked first (lanes.vision.headers); pixels are decoded only once they pass.
"""

from dataclasses import dataclass

import av
import numpy as np
from PIL import Image, ImageOps

from lanes.vision.errors import MediaRejected
from lanes.vision.headers import (
    MAX_IMAGE_PIXELS,
    PILLOW_DATA_ERRORS,
    Sampling,
    VideoHeader,
    open_image,
    open_video,
    video_header,
)

# Rows composited onto white at a time: a strip's RGBA copies are held, never the whole image's.
STRIP_ROWS = 256


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' `convert_to_rgb` makes it: any transparency composited onto white.

    Compositing is per pixel, so it runs strip by strip into one RGB image: the same pixels as the whole
    image at once, without its three full-size RGBA copies."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        out = Image.new("RGB", image.size)
        for top in range(0, image.height, STRIP_ROWS):
            strip = image.crop((0, top, image.width, min(image.height, top + STRIP_ROWS)))
            out.paste(_over_white(strip), (0, top))
        return out
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def _over_white(image: Image.Image) -> Image.Image:
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def decode_image(data: bytes, *, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """A JPEG or PNG as a fully loaded RGB image, upright by its EXIF orientation, alpha over white.

    The pixel count in the header is checked against `max_pixels` before any pixel is decoded.
    Raises `MediaRejected` (image_unreadable, image_format, image_too_large, image_truncated).
    """
    image = open_image(data, max_pixels)  # not closed on success: closing drops the pixels returned
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # in place: no copy of an image already upright
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        image.close()
        raise MediaRejected("image_too_large") from None
    except PILLOW_DATA_ERRORS:
        image.close()
        raise MediaRejected("image_truncated") from None
    return to_rgb(image)


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


def decode_video(data: bytes, **sampling) -> VideoFrames:
    """An mp4's first video stream, sampled as transformers samples it (see `sample_frame_indices`).

    `sampling` overrides `Sampling`'s fields (fps, min_frames, max_frames, temporal_patch_size,
    max_pixels, max_total_frames, max_sampled_pixels). Frames are those transformers' pyav reader takes
    for the same indices: decoded in order from the start, converted to rgb24. The boxes are probed
    before FFmpeg reads any, and sizes and counts are checked before any frame is decoded.
    Raises `MediaRejected` (video_unreadable, video_malformed, video_codec, video_no_stream,
    video_too_large, video_too_long, video_too_short).
    """
    limits = Sampling(**sampling)
    return decode_frames(video_header(data, limits), limits)


def decode_frames(header: VideoHeader, sampling: Sampling) -> VideoFrames:
    """The frames `header` says sampling takes (counted first when the container gives no count)."""
    total, indices = header.total_frames, header.indices
    try:
        if header.counted:
            total = _count_frames(header.data, sampling.max_pixels, sampling.max_total_frames)
            indices = sampling.indices(total, header.video_fps, header.width, header.height)
        with open_video(header.data, sampling.max_pixels) as container:
            frames, taken = _collect(container, container.streams.video[0], indices, (header.height, header.width))
    except MediaRejected:
        raise
    except (av.error.FFmpegError, OSError, ValueError):
        raise MediaRejected("video_unreadable") from None
    if not taken:
        raise MediaRejected("video_too_short")
    return VideoFrames(frames=frames[: len(taken)], indices=taken, total_frames=total, video_fps=header.video_fps)


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
) -> tuple[np.ndarray, tuple[int, ...]]:
    """The frames at `indices` as rgb24 in one array, decoding in order from the start as transformers does."""
    wanted = set(indices)
    frames = np.empty((len(indices), *shape, 3), dtype=np.uint8)  # [T, H, W, 3]: written in place, never stacked
    taken: list[int] = []
    for i, frame in enumerate(container.decode(stream)):
        if i > indices[-1]:
            break
        if i not in wanted:
            continue
        # a stream may change size midway; the processors stack frames of one size
        if (frame.height, frame.width) != shape:
            raise MediaRejected("video_unreadable")
        frames[len(taken)] = frame.to_ndarray(format="rgb24")  # [H, W, 3] uint8
        taken.append(i)
    return frames, tuple(taken)
