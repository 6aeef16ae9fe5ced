"""Decoding images and videos into pixels, and every refusal by its exact code.

Rules: every input is made here in memory (Pillow encodes the images, av the mp4s, a few PNGs are
written chunk by chunk to lie about their size); pixel content is random from fixed numpy seeds.
References are transformers' own: `convert_to_rgb` for transparency, `read_video_pyav` for which
decoded frames a set of indices gives, and frame indices recorded from `Qwen2VLVideoProcessor.
sample_frames` (transformers 5.24 with torchvision, which cannot be imported beside this torch).
"""

import io
import struct
import warnings
import zlib

import av
import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb
from transformers.video_utils import read_video_pyav

from lanes.vision.decode import STRIP_ROWS, decode_image, decode_video
from lanes.vision.headers import MAX_IMAGE_PIXELS, sample_frame_indices
from lanes.vision.errors import CODES, MediaRejected
from mp4_boxes import make_mp4, random_clip


def random_rgb(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def grey_png(width: int, height: int, idat: bytes | None = None) -> bytes:
    """An 8-bit greyscale PNG; all black unless `idat` replaces its pixel data."""
    if idat is None:
        packer = zlib.compressobj(1)
        row = bytes(1 + width)  # filter byte 0, then black
        idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def rejected(code: str, call, *args, **kwargs) -> None:
    with pytest.raises(MediaRejected) as caught:
        call(*args, **kwargs)
    assert caught.value.code == code
    assert str(caught.value) == code


# --- images ---


def test_png_decodes_to_its_pixels() -> None:
    pixels = random_rgb(33, 47)
    image = decode_image(encode(Image.fromarray(pixels), "PNG"))
    assert image.mode == "RGB" and image.size == (47, 33)
    assert np.array_equal(np.asarray(image), pixels)


def test_jpeg_decodes_as_pillow_decodes_it() -> None:
    data = encode(Image.fromarray(random_rgb(40, 52, seed=1)), "JPEG", quality=90)
    image = decode_image(data)
    assert image.mode == "RGB" and image.size == (52, 40)
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "1", "I;16"])
def test_modes_become_rgb_as_transformers_converts_them(mode: str) -> None:
    rng = np.random.default_rng(2)
    source = Image.fromarray(random_rgb(21, 30, seed=2))
    if mode in ("RGBA", "LA"):
        alpha = Image.fromarray(rng.integers(0, 256, (21, 30), dtype=np.uint8))
        source = Image.merge("RGBA", (*source.split(), alpha)).convert(mode)
    elif mode == "I;16":
        source = Image.fromarray(rng.integers(0, 65536, (21, 30), dtype=np.uint16))
    else:
        source = source.convert(mode)
    data = encode(source, "PNG", **({"transparency": 7} if mode == "P" else {}))
    expected = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    assert np.array_equal(np.asarray(decode_image(data)), expected)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "L"])
def test_transparency_composited_strip_by_strip_equals_transformers_whole(mode: str) -> None:
    # 600 rows: three strips of STRIP_ROWS, the last one short
    rng = np.random.default_rng(14)
    source = Image.fromarray(random_rgb(600, 37, seed=14))
    alpha = Image.fromarray(rng.integers(0, 256, (600, 37), dtype=np.uint8))
    if mode in ("RGBA", "LA"):
        source = Image.merge("RGBA", (*source.split(), alpha)).convert(mode)
    else:
        source = source.convert(mode)
    data = encode(source, "PNG", **({} if mode in ("RGBA", "LA") else {"transparency": 7}))
    assert 600 > 2 * STRIP_ROWS and Image.open(io.BytesIO(data)).info.get("transparency", 7) == 7
    expected = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    assert np.array_equal(np.asarray(decode_image(data)), expected)


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(Image.fromarray(random_rgb(20, 36, seed=3)), "JPEG", exif=exif)
    assert decode_image(data).size == (20, 36)


def test_a_multi_picture_jpeg_is_a_jpeg() -> None:
    first, second = (Image.fromarray(random_rgb(24, 32, seed=seed)) for seed in (20, 21))
    data = encode(first, "MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(data)).format == "MPO"
    assert np.array_equal(np.asarray(decode_image(data)), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


@pytest.mark.parametrize("data", [b"", b"hello" * 20, bytes(1000), random_rgb(1, 400, seed=4).tobytes()])
def test_junk_is_unreadable(data: bytes) -> None:
    rejected("image_unreadable", decode_image, data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_images_are_refused(fmt: str) -> None:
    data = encode(Image.fromarray(random_rgb(64, 80, seed=5)), fmt)
    rejected("image_truncated", decode_image, data[: len(data) // 2])


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "WEBP", "TIFF"])
def test_other_formats_are_refused(fmt: str) -> None:
    rejected("image_format", decode_image, encode(Image.fromarray(random_rgb(16, 16, seed=6)), fmt))


def test_a_bomb_within_pillows_limit_is_refused_by_ours() -> None:
    # 9000 x 9000 black: 81 Mpx in a 79 kB PNG, under Pillow's own warning threshold
    rejected("image_too_large", decode_image, grey_png(9000, 9000))
    assert 9000 * 9000 > MAX_IMAGE_PIXELS


def test_the_size_is_checked_before_any_pixel_is_decoded() -> None:
    # the header claims 9000 x 9000; the pixel data is junk, which only decoding would find
    liar = grey_png(9000, 9000, idat=b"not zlib at all")
    rejected("image_too_large", decode_image, liar)
    rejected("image_truncated", decode_image, liar, max_pixels=10**9)


@pytest.mark.parametrize("side", [10_000, 20_000])
def test_bombs_pillow_warns_or_errs_about_are_too_large(side: int) -> None:
    # Pillow warns between 89 and 179 Mpx and errs above; either way, whatever the warnings filter
    liar = grey_png(side, side, idat=zlib.compress(bytes(1 + side)))
    for action in ("ignore", "error"):
        with warnings.catch_warnings():
            warnings.simplefilter(action)
            rejected("image_too_large", decode_image, liar)


def test_a_lower_pixel_limit_is_honoured() -> None:
    data = encode(Image.fromarray(random_rgb(30, 40, seed=7)), "PNG")
    rejected("image_too_large", decode_image, data, max_pixels=30 * 40 - 1)
    assert decode_image(data, max_pixels=30 * 40).size == (40, 30)


# --- videos ---

# Recorded from transformers 5.24's Qwen2VLVideoProcessor.sample_frames(VideoMetadata(total, video_fps),
# fps=fps, min_frames=..., max_frames=...) with torchvision 0.26. Two end in total_frames itself (49 and 30):
# torch.arange's length rounding adds that index, which no decoded frame has, so no reader ever gets it.
RECORDED_SAMPLES = [
    ((30, 10.0, 2.0, 4, 768), [0, 5, 10, 15, 20, 25]),
    ((30, 30.0, 2.0, 4, 768), [0, 7, 15, 22]),
    ((17, 7.0, 5.0, 4, 768), [0, 1, 2, 4, 5, 7, 8, 9, 11, 12, 14, 15]),
    (
        (49, 5.0, 4.5, 4, 768),
        [
            0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17, 18, 20, 21, 22, 23, 24, 25, 26, 27, 28, 30, 31,
            32, 33, 34, 35, 36, 37, 38, 40, 41, 42, 43, 44, 45, 46, 47, 49
        ],
    ),
    (
        (1000, 29.97, 2.0, 4, 768),
        [
            0, 15, 30, 45, 60, 75, 90, 106, 121, 136, 151, 166, 181, 196, 212, 227, 242, 257, 272, 287, 303, 318, 333,
            348, 363, 378, 393, 409, 424, 439, 454, 469, 484, 500, 515, 530, 545, 560, 575, 590, 606, 621, 636, 651,
            666, 681, 696, 712, 727, 742, 757, 772, 787, 803, 818, 833, 848, 863, 878, 893, 909, 924, 939, 954, 969, 984
        ],
    ),
    ((3, 30.0, 2.0, 4, 768), [0, 1]),
    ((9000, 30.0, 2.0, 4, 768), list(range(0, 9000, 15))),
    ((100, 25.0, 2.0, 4, 16), [0, 12, 25, 37, 50, 62, 75, 87]),
    ((2, 1.0, 2.0, 4, 768), [0, 1]),
    ((61, 30.0, 2.0, 4, 768), [0, 15, 30, 45]),
    (
        (30, 10.0, 26 / 3, 4, 768),
        [
            0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 15, 16, 17, 18, 19, 20, 21, 23, 24, 25, 26, 27, 28, 30
        ],
    ),
]


@pytest.mark.parametrize(("args", "recorded"), RECORDED_SAMPLES)
def test_frame_indices_equal_qwen2vl_sample_frames(args: tuple, recorded: list[int]) -> None:
    total, video_fps, fps, min_frames, max_frames = args
    ours = sample_frame_indices(total, video_fps, fps=fps, min_frames=min_frames, max_frames=max_frames)
    assert list(ours) == [i for i in recorded if i < total]
    assert len(ours) % 2 == 0


def test_too_few_frames_to_sample() -> None:
    rejected("video_too_short", sample_frame_indices, 1, 30.0)


@pytest.mark.parametrize("codec", ["libx264", "mpeg4"])
def test_frames_are_those_transformers_pyav_reader_takes(codec: str) -> None:
    # 3 s at 10 fps of changing random frames; 2 fps gives 6 frames, one every 5
    data = make_mp4(random_clip(30, seed=8), rate=10, codec=codec)
    video = decode_video(data)
    assert video.indices == (0, 5, 10, 15, 20, 25)
    assert (video.total_frames, video.video_fps, video.sampled_fps) == (30, 10.0, 2.0)
    expected, metadata = read_video_pyav(io.BytesIO(data), lambda metadata, **_: np.array(video.indices))
    assert (metadata.total_num_frames, metadata.fps) == (30, 10.0)
    assert video.frames.dtype == np.uint8 and video.frames.shape == (6, 48, 64, 3)
    assert np.array_equal(video.frames, expected)


def test_min_frames_and_max_frames_bound_the_count() -> None:
    data = make_mp4(random_clip(30, seed=9), rate=30)  # 1 s: 2 fps asks for 2, min_frames makes it 4
    assert decode_video(data).indices == (0, 7, 15, 22)
    assert decode_video(data, fps=30.0, max_frames=10).indices == (0, 3, 6, 9, 12, 15, 18, 21, 24, 27)


def test_a_fragmented_mp4_without_a_frame_count_is_counted() -> None:
    clip = random_clip(30, seed=10)
    plain = decode_video(make_mp4(clip))
    data = make_mp4(clip, options={"movflags": "frag_keyframe+empty_moov"})
    with av.open(io.BytesIO(data), format="mp4") as container:
        assert container.streams.video[0].frames == 0  # the header really has no count
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    fragmented = decode_video(data)
    assert fragmented.indices == plain.indices and fragmented.total_frames == 30 == len(decoded)
    # the frames taken after counting are the ones a single decoding pass gives at those indices
    assert np.array_equal(fragmented.frames, np.stack([decoded[i] for i in fragmented.indices]))


@pytest.mark.parametrize("cut", ["junk", "zeros", "half", "tail", "flipped", "empty"])
def test_corrupt_mp4_is_unreadable(cut: str) -> None:
    data = make_mp4(random_clip(30, seed=11))
    corrupt = {
        "junk": b"hello" * 200,
        "zeros": bytes(2000),
        "half": data[: len(data) // 2],
        "tail": data[:-2000],
        "flipped": data[:2000] + bytes(b ^ 0xFF for b in data[2000:4000]) + data[4000:],
        "empty": b"",
    }[cut]
    rejected("video_unreadable", decode_video, corrupt)


def test_an_image_is_not_a_video() -> None:
    rejected("video_unreadable", decode_video, encode(Image.fromarray(random_rgb(16, 16)), "PNG"))


def test_audio_only_has_no_video_stream() -> None:
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    rejected("video_no_stream", decode_video, out.getvalue())


def test_one_frame_is_too_short() -> None:
    rejected("video_too_short", decode_video, make_mp4(random_clip(1, seed=12)))


def test_video_limits() -> None:
    data = make_mp4(random_clip(30, seed=13))
    rejected("video_too_large", decode_video, data, max_pixels=48 * 64 - 1)
    rejected("video_too_long", decode_video, data, max_total_frames=29)
    rejected("video_too_large", decode_video, data, max_sampled_pixels=6 * 48 * 64 - 1)
    assert len(decode_video(data, max_total_frames=30, max_sampled_pixels=6 * 48 * 64).indices) == 6


def test_every_code_has_its_frozen_words() -> None:
    from lanes.http import media_fetch
    from lanes.http.errors import MEDIA_WORDS

    for code in CODES:
        assert MediaRejected(code).code == code and code in MEDIA_WORDS
    assert set(MEDIA_WORDS) == set(CODES) | set(media_fetch.CODES)  # every fetch refusal too, and nothing else
    with pytest.raises(KeyError):
        MediaRejected("no_such_code")
