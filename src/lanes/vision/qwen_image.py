"""Qwen2-VL / Qwen2.5-VL preprocessing: resize to the patch grid, normalise, patchify, as transformers does.

Images follow `Qwen2VLImageProcessorPil` (Pillow bicubic, rescale in float64, normalise in float32).
Videos follow `Qwen2VLVideoProcessor` on the CPU, whose torchvision resize of uint8 frames is
`torch.nn.functional.interpolate(uint8, "bicubic", antialias=True)` and whose rescale and normalise
are fused into one float32 `(x - 255 * mean) / (255 * std)`; neither needs torchvision here.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from lanes.vision.decode import to_rgb
from lanes.vision.errors import MediaRejected

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# The largest side over the smallest that smart_resize takes.
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class VisionParams:
    """The numbers of a Qwen2-VL image or video processor; the defaults are transformers' image ones."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        sizes = (self.patch_size, self.temporal_patch_size, self.merge_size, self.min_pixels, self.max_pixels)
        if any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in sizes):
            raise ValueError(f"vision sizes must be positive integers: {sizes}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} is above max_pixels {self.max_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or min(self.image_std) <= 0:
            raise ValueError("image_mean and image_std need three values, std positive")
        if not self.rescale_factor > 0:
            raise ValueError(f"rescale_factor must be positive: {self.rescale_factor}")

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (one merged patch)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_preprocessor_config(cls, config: Mapping, *, video: bool = False) -> "VisionParams":
        """Parameters from a Hugging Face `preprocessor_config.json` (or `video_preprocessor_config.json`).

        Pixel bounds are read as transformers reads them: `size: {shortest_edge, longest_edge}`,
        overridden by top-level `min_pixels` / `max_pixels`. With `video=True`, what the file leaves
        out falls back to the video processor's defaults (`VIDEO_DEFAULTS`), as transformers'
        video processor falls back to its own when it reads `preprocessor_config.json`.
        """
        base = VIDEO_DEFAULTS if video else IMAGE_DEFAULTS
        size = config.get("size") or {}
        if not isinstance(size, Mapping):
            raise ValueError(f"preprocessor config: size must be an object, got {size!r}")
        min_pixels = config.get("min_pixels", size.get("shortest_edge", base.min_pixels))
        max_pixels = config.get("max_pixels", size.get("longest_edge", base.max_pixels))
        return cls(
            patch_size=config.get("patch_size", base.patch_size),
            temporal_patch_size=config.get("temporal_patch_size", base.temporal_patch_size),
            merge_size=config.get("merge_size", base.merge_size),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            image_mean=tuple(float(v) for v in config.get("image_mean", base.image_mean)),
            image_std=tuple(float(v) for v in config.get("image_std", base.image_std)),
            rescale_factor=float(config.get("rescale_factor", base.rescale_factor)),
        )


IMAGE_DEFAULTS = VisionParams()
# Qwen2VLVideoProcessor's own bounds: 128 to 768 merged patches a frame.
VIDEO_DEFAULTS = VisionParams(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28)


@dataclass(frozen=True, eq=False)
class Visual:
    """One image or video ready for the vision tower, laid out exactly as transformers lays it out."""

    kind: Literal["image", "video"]
    pixel_values: torch.Tensor  # [t * h * w, 3 * temporal_patch * patch * patch] float32, CPU
    grid: tuple[int, int, int]  # (t, h, w) in patches
    tokens: int  # placeholder tokens in the prompt: t * h * w // merge_size**2


def smart_resize(
    height: int, width: int, params: VisionParams = IMAGE_DEFAULTS, *, kind: str = "image"
) -> tuple[int, int]:
    """The (height, width) transformers' `smart_resize` picks: multiples of `params.factor`,
    between min_pixels and max_pixels, close to the aspect ratio.

    Raises `MediaRejected` ({kind}_aspect_ratio) where transformers raises its ValueError.
    """
    factor, min_pixels, max_pixels = params.factor, params.min_pixels, params.max_pixels
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaRejected(f"{kind}_aspect_ratio")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def visual_grid(
    height: int, width: int, params: VisionParams = IMAGE_DEFAULTS, *, frames: int = 1, kind: str = "image"
) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of an image (frames=1) or of `frames` sampled video frames, no pixels needed."""
    resized_h, resized_w = smart_resize(height, width, params, kind=kind)
    grid_t = -(-frames // params.temporal_patch_size)
    return grid_t, resized_h // params.patch_size, resized_w // params.patch_size


def preprocess_image(image: Image.Image, params: VisionParams = IMAGE_DEFAULTS) -> Visual:
    """`Qwen2VLImageProcessorPil` on one image: same pixel values bit for bit, grid (1, h, w).

    Any mode is taken (alpha composited onto white). Raises `MediaRejected` (image_aspect_ratio).
    """
    image = to_rgb(image)
    height, width = smart_resize(image.height, image.width, params, kind="image")
    resized = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(resized)  # [H, W, 3] uint8
    rescaled = pixels.astype(np.float64)
    rescaled *= params.rescale_factor  # in place, as every step below: the same values, no temporaries
    normalized = rescaled.astype(np.float32)  # [H, W, 3] float32
    del rescaled
    normalized -= np.array(params.image_mean, dtype=np.float32)
    normalized /= np.array(params.image_std, dtype=np.float32)
    chw = torch.from_numpy(normalized).permute(2, 0, 1)  # [3, H, W] float32
    # an image is a clip of temporal_patch_size copies of itself
    clip = chw.unsqueeze(0).expand(params.temporal_patch_size, -1, -1, -1)  # [tp, 3, H, W]
    return _visual("image", clip, params)


def preprocess_video(frames: np.ndarray, params: VisionParams = VIDEO_DEFAULTS) -> Visual:
    """`Qwen2VLVideoProcessor` (CPU, no frame sampling) on frames already sampled: same pixel values, grid.

    `frames`: [T, H, W, 3] uint8 RGB, as `decode_video` gives them. The frame count is padded to
    a multiple of temporal_patch_size by repeating the last frame. Raises `MediaRejected`
    (video_aspect_ratio, video_too_short for no frames).
    """
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be [T, H, W, 3] uint8, got {frames.shape} {frames.dtype}")
    if frames.shape[0] == 0:
        raise MediaRejected("video_too_short")
    # [T, 3, H, W] uint8 in channels-last strides: no copy, and the resize gives the same values from it
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    height, width = smart_resize(video.shape[2], video.shape[3], params, kind="video")
    if (height, width) != tuple(video.shape[2:]):
        # torchvision's resize_image on CPU uint8 bicubic calls exactly this, natively in uint8
        video = F.interpolate(video, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    mean = torch.tensor(params.image_mean, dtype=torch.float32) * (1.0 / params.rescale_factor)  # [3]
    std = torch.tensor(params.image_std, dtype=torch.float32) * (1.0 / params.rescale_factor)  # [3]
    normalized = video.to(torch.float32)  # [T, 3, H, W] float32
    normalized.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))  # in place: (x - mean) / std, no temporaries
    if pad := -normalized.shape[0] % params.temporal_patch_size:
        normalized = torch.cat((normalized, normalized[-1:].expand(pad, -1, -1, -1)))
    return _visual("video", normalized, params)


def _visual(kind: Literal["image", "video"], clip: torch.Tensor, params: VisionParams) -> Visual:
    """Patchify a clip `[T, 3, H, W]` float32 (T a multiple of temporal_patch_size) in transformers' order."""
    patch, temporal, merge = params.patch_size, params.temporal_patch_size, params.merge_size
    frames, channels, height, width = clip.shape
    grid_t, grid_h, grid_w = frames // temporal, height // patch, width // patch
    patches = clip.reshape(
        grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch
    )
    # (t, h-blocks, w-blocks, h-in-block, w-in-block, channel, temporal, patch row, patch column)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    pixel_values = patches.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch)
    return Visual(
        kind=kind,
        pixel_values=pixel_values.contiguous(),  # [t * h * w, 1176] float32 with the defaults
        grid=(grid_t, grid_h, grid_w),
        tokens=grid_t * grid_h * grid_w // merge**2,
    )
