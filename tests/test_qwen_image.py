"""Qwen2-VL preprocessing against transformers' processors: same pixel values, same grids.

Rules: pixel content is random from fixed numpy seeds (or, where a value was recorded elsewhere, a
fixed integer hash of the position); every comparison is exact unless a tolerance is named.

Images: the reference is transformers' `Qwen2VLImageProcessorPil` run here on the same PIL image
(or on the same encoded bytes opened by Pillow), compared bit for bit.

Videos: `Qwen2VLVideoProcessor` imports torchvision, which cannot be installed beside this torch,
so it is checked two ways.
1. Recorded: the processor's pixel values (transformers 5.24, torchvision 0.26, torch 2.11, CPU) were
   hashed for fixed frames on a machine that has torchvision; ours must give the same SHA-256, i.e.
   the same float32 bits.
2. Rebuilt here from transformers' parts, as video_processing_qwen2_vl.py does it: the grid from
   transformers' `smart_resize` with the video processor's bounds; every frame resized as its
   torchvision `resize` does on a CPU uint8 tensor with BICUBIC, which is a call of
   `torch.nn.functional.interpolate(uint8, mode="bicubic", antialias=True, align_corners=False)`
   (torchvision's `_do_native_uint8_resize_on_cpu` is true for bicubic); each resized frame
   rescaled, normalised and patchified by `Qwen2VLImageProcessorPil(do_resize=False)`; the frame count
   padded to a multiple of temporal_patch_size with the last frame; consecutive frames' patches
   paired along the temporal axis, which is the order of the video processor's `patchify`. The
   video processor fuses rescale and normalise into one float32 `(x - 255 mean) / (255 std)`, the
   image processor rescales in float64 first, so this path differs by float32 rounding: <= 1e-6.
   The video processor does not resize with Pillow: Pillow's bicubic differs from torch's uint8
   kernel by up to ~20 levels on random pixels, which is why no Pillow-resized frame is the reference.
"""

import hashlib
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from lanes.vision.decode import decode_image, decode_video
from lanes.vision.errors import MediaRejected
from lanes.vision.qwen_image import (
    IMAGE_DEFAULTS,
    VIDEO_DEFAULTS,
    VisionParams,
    preprocess_image,
    preprocess_video,
    visual_grid,
)
from tests.test_media_decode import encode, make_mp4, random_clip, random_rgb

# The bounds transformers' Qwen2VLVideoProcessor has as class defaults (video_processing_qwen2_vl.py).
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 128 * 28 * 28, 28 * 28 * 768


def reference_image(image: Image.Image, **options) -> tuple[torch.Tensor, tuple[int, ...]]:
    out = Qwen2VLImageProcessorPil(**options)(image, return_tensors="pt")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


def assert_same_image(image: Image.Image, params: VisionParams = IMAGE_DEFAULTS, **options) -> None:
    expected, grid = reference_image(image, **options)
    ours = preprocess_image(image, params)
    assert ours.kind == "image" and ours.grid == grid
    assert ours.pixel_values.dtype == torch.float32 and ours.pixel_values.shape == expected.shape
    assert torch.equal(ours.pixel_values, expected)
    assert ours.tokens == grid[0] * grid[1] * grid[2] // 4


@pytest.mark.parametrize(
    ("height", "width"),
    [
        (1, 1),  # grows to the minimum
        (10, 300),
        (28, 28),
        (55, 57),  # rounds to the nearest multiple of 28
        (300, 451),
        (1024, 768),
        (2000, 3000),  # over max_pixels: shrinks
        (4000, 60),
        (3, 600),  # aspect ratio 200, the most allowed
        (1, 150),
    ],
)
def test_images_equal_transformers(height: int, width: int) -> None:
    assert_same_image(Image.fromarray(random_rgb(height, width, seed=height * 7 + width)))


def test_the_documented_example() -> None:
    ours = preprocess_image(Image.fromarray(random_rgb(300, 451)))
    assert tuple(ours.pixel_values.shape) == (704, 1176) and ours.grid == (1, 22, 32) and ours.tokens == 176


@pytest.mark.parametrize(("height", "width"), [(1, 201), (300, 1), (2, 401)])
def test_extreme_aspect_ratios_are_refused_as_transformers_refuses_them(height: int, width: int) -> None:
    image = Image.fromarray(random_rgb(height, width, seed=3))
    with pytest.raises(ValueError, match="aspect ratio"):
        reference_image(image)
    with pytest.raises(MediaRejected) as caught:
        preprocess_image(image)
    assert caught.value.code == "image_aspect_ratio"


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P"])
def test_png_modes_through_decoding_equal_transformers(mode: str) -> None:
    rng = np.random.default_rng(5)
    source = Image.fromarray(random_rgb(90, 70, seed=5))
    if mode in ("RGBA", "LA"):
        alpha = Image.fromarray(rng.integers(0, 256, (90, 70), dtype=np.uint8))
        source = Image.merge("RGBA", (*source.split(), alpha)).convert(mode)
    else:
        source = source.convert(mode)
    data = encode(source, "PNG", **({"transparency": 3} if mode == "P" else {}))
    expected, grid = reference_image(Image.open(io.BytesIO(data)))
    ours = preprocess_image(decode_image(data))
    assert ours.grid == grid and torch.equal(ours.pixel_values, expected)
    # preprocessing takes the undecoded modes too, converting them the same way
    assert torch.equal(preprocess_image(Image.open(io.BytesIO(data))).pixel_values, expected)


def test_jpeg_through_decoding_equals_transformers() -> None:
    data = encode(Image.fromarray(random_rgb(375, 500, seed=6)), "JPEG", quality=85)
    expected, grid = reference_image(Image.open(io.BytesIO(data)))
    ours = preprocess_image(decode_image(data))
    assert ours.grid == grid and torch.equal(ours.pixel_values, expected)


def test_grids_equal_smart_resize_on_a_sweep() -> None:
    sizes = np.random.default_rng(7).integers(1, 5000, (400, 2))
    for params in (IMAGE_DEFAULTS, VIDEO_DEFAULTS, VisionParams(min_pixels=3136, max_pixels=12845056)):
        for height, width in sizes.tolist():
            if max(height, width) / min(height, width) > 200:
                continue
            h, w = smart_resize(height, width, factor=28, min_pixels=params.min_pixels, max_pixels=params.max_pixels)
            assert visual_grid(height, width, params) == (1, h // 14, w // 14)
            assert visual_grid(height, width, params, frames=7, kind="video") == (4, h // 14, w // 14)


def test_defaults_equal_transformers() -> None:
    processor = Qwen2VLImageProcessorPil()
    assert (IMAGE_DEFAULTS.min_pixels, IMAGE_DEFAULTS.max_pixels) == (
        processor.size["shortest_edge"],
        processor.size["longest_edge"],
    )
    assert (IMAGE_DEFAULTS.patch_size, IMAGE_DEFAULTS.temporal_patch_size, IMAGE_DEFAULTS.merge_size) == (
        processor.patch_size,
        processor.temporal_patch_size,
        processor.merge_size,
    )
    assert IMAGE_DEFAULTS.image_mean == tuple(processor.image_mean)
    assert IMAGE_DEFAULTS.image_std == tuple(processor.image_std)
    assert IMAGE_DEFAULTS.rescale_factor == processor.rescale_factor
    assert (VIDEO_DEFAULTS.min_pixels, VIDEO_DEFAULTS.max_pixels) == (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)


@pytest.mark.parametrize(
    "config",
    [
        {"min_pixels": 3136, "max_pixels": 200704, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2},
        {"size": {"shortest_edge": 3136, "longest_edge": 200704}},
        {"size": {"shortest_edge": 50000, "longest_edge": 10**7}, "max_pixels": 200704},  # min/max_pixels win
    ],
)
def test_preprocessor_configs_are_read_as_transformers_reads_them(config: dict) -> None:
    full = {**config, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.5, 0.75]}
    params = VisionParams.from_preprocessor_config(full)
    processor = Qwen2VLImageProcessorPil(**full)
    assert (params.min_pixels, params.max_pixels) == (processor.size["shortest_edge"], processor.size["longest_edge"])
    assert_same_image(Image.fromarray(random_rgb(700, 900, seed=8)), params, **full)


def test_a_video_config_falls_back_to_the_video_defaults() -> None:
    assert VisionParams.from_preprocessor_config({}, video=True) == VIDEO_DEFAULTS
    assert VisionParams.from_preprocessor_config({"max_pixels": 10**6}, video=True).min_pixels == VIDEO_MIN_PIXELS
    assert VisionParams.from_preprocessor_config({}) == IMAGE_DEFAULTS


@pytest.mark.parametrize("config", [{"min_pixels": 10, "max_pixels": 5}, {"patch_size": 0}, {"size": 5}])
def test_bad_configs_are_refused(config: dict) -> None:
    with pytest.raises(ValueError):
        VisionParams.from_preprocessor_config(config)


# --- videos ---


def reference_video(frames: np.ndarray, min_pixels: int = VIDEO_MIN_PIXELS, max_pixels: int = VIDEO_MAX_PIXELS):
    """Qwen2VLVideoProcessor rebuilt from transformers' parts (see the module docstring)."""
    count, height, width, _ = frames.shape
    resized_h, resized_w = smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    if (resized_h, resized_w) != (height, width):
        video = F.interpolate(video, size=[resized_h, resized_w], mode="bicubic", align_corners=False, antialias=True)
    processor = Qwen2VLImageProcessorPil(do_resize=False)
    per_frame = [processor(frame.permute(1, 2, 0).numpy(), return_tensors="pt")["pixel_values"] for frame in video]
    if count % 2:
        per_frame.append(per_frame[-1])
    pairs = []
    for first, second in zip(per_frame[0::2], per_frame[1::2]):
        # an image's patch is [3, 2, 14, 14] with both temporal slots its own; a video's takes one from each
        first, second = first.view(-1, 3, 2, 14, 14), second.view(-1, 3, 2, 14, 14)
        pairs.append(torch.stack((first[:, :, 0], second[:, :, 0]), dim=2).reshape(first.shape[0], -1))
    return torch.cat(pairs), (len(pairs), resized_h // 14, resized_w // 14)


def assert_same_video(frames: np.ndarray, params: VisionParams = VIDEO_DEFAULTS) -> None:
    expected, grid = reference_video(frames, params.min_pixels, params.max_pixels)
    ours = preprocess_video(frames, params)
    assert ours.kind == "video" and ours.grid == grid and ours.tokens == grid[0] * grid[1] * grid[2] // 4
    assert ours.pixel_values.dtype == torch.float32 and ours.pixel_values.shape == expected.shape
    assert (ours.pixel_values - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    ("count", "height", "width"),
    [(5, 90, 160), (4, 480, 640), (2, 448, 560), (3, 37, 1000), (2, 1080, 1920), (1, 10, 300)],
)
def test_videos_equal_the_rebuilt_processor(count: int, height: int, width: int) -> None:
    assert_same_video(random_clip(count, height, width, seed=count + height))


def test_video_with_the_image_bounds_of_a_checkpoint() -> None:
    assert_same_video(random_clip(4, 300, 451, seed=9), VisionParams(min_pixels=3136, max_pixels=12845056))


def test_an_mp4_made_here_equals_the_rebuilt_processor() -> None:
    # 3 s at 10 fps of changing random frames, sampled at 2 fps into 6 frames
    video = decode_video(make_mp4(random_clip(30, 120, 160, seed=10), rate=10))
    assert video.frames.shape == (6, 120, 160, 3)
    assert_same_video(video.frames)
    assert preprocess_video(video.frames).grid == (3, 20, 28)


def pattern_frames(count: int, height: int, width: int) -> np.ndarray:
    """Frames from a fixed integer hash of (frame, row, column, channel), the same under any numpy."""
    u = np.uint64
    plane = (np.arange(height, dtype=u)[:, None, None] * u(19349663)) ^ (
        np.arange(width, dtype=u)[None, :, None] * u(83492791)
    )  # [H, W, 1] uint64
    channels = np.arange(3, dtype=u) * u(2654435761)  # [3] uint64
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    for f in range(count):
        # uint64 products wrap; the top byte of the mixed value is the pixel
        frames[f] = (((plane ^ u(f * 73856093) ^ channels) * u(0x9E3779B97F4A7C15)) >> u(56)).astype(np.uint8)
    return frames


# SHA-256 of Qwen2VLVideoProcessor's pixel_values_videos (float32 bytes) on pattern_frames(count, h, w),
# with the processor's default bounds or the image bounds given; recorded with torchvision (see above).
RECORDED_VIDEOS = [
    ((5, 90, 160), None, (3, 18, 32), "5c14c9da97061b7efb7aa831cbf89263ccc2223a8ddec78ff8e85954a69472f6"),
    ((4, 480, 640), None, (2, 34, 46), "42e878401afae06031813eb88ea89a175c452fb17d4bbcb18a6de75d35b805d4"),
    ((2, 448, 560), None, (1, 32, 40), "8b2009d59bc7674a919df12cace08508029052ed89efe1cf80ad26cc8a6a475c"),
    ((6, 1080, 1920), None, (3, 40, 72), "b70606263f603e7fefa87af1dd53e72f259e43725534de2f7fcf01f63f914f1b"),
    ((3, 37, 1000), None, (2, 6, 118), "81aa4002451c05b865767a670b15cf896885e90ff08ba88054ab36d681977bd3"),
    ((4, 300, 451), (3136, 12845056), (2, 22, 32), "ae024a45b33da7f94e52b012de405fd96920193c951474ebd59836313fcd9a3b"),
]


@pytest.mark.parametrize(("shape", "bounds", "grid", "digest"), RECORDED_VIDEOS)
def test_videos_equal_the_recorded_processor_bit_for_bit(shape, bounds, grid, digest) -> None:
    params = VIDEO_DEFAULTS if bounds is None else VisionParams(min_pixels=bounds[0], max_pixels=bounds[1])
    ours = preprocess_video(pattern_frames(*shape), params)
    assert ours.grid == grid
    assert hashlib.sha256(ours.pixel_values.numpy().tobytes()).hexdigest() == digest


def test_video_aspect_ratio_and_empty_input_are_refused() -> None:
    with pytest.raises(MediaRejected) as caught:
        preprocess_video(random_clip(2, 2, 500))
    assert caught.value.code == "video_aspect_ratio"
    with pytest.raises(MediaRejected) as caught:
        preprocess_video(np.zeros((0, 28, 28, 3), dtype=np.uint8))
    assert caught.value.code == "video_too_short"
