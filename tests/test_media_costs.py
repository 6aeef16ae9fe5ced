"""What a part costs to decode, as measured from its headers, against what decoding it really holds.

Rules: images and videos are made here (Pillow, av); one child process decodes and preprocesses each part
as the server does (`lanes.vision.measure`), its peak resident memory reset before each part through
/proc/self/clear_refs and read back from VmHWM. A cost must bound the peak and stay within 3x of it.
"""

import io
import subprocess
import sys

import numpy as np
from PIL import Image

from lanes.vision.headers import FIXED_COST
from mp4_boxes import make_mp4, random_clip

SIDE = 2048


def smooth_rgb(side: int) -> np.ndarray:
    y, x = np.mgrid[0:side, 0:side]
    return np.stack([x * 255 // side, y * 255 // side, (x + y) * 255 // (2 * side)], -1).astype(np.uint8)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def cases() -> dict[str, tuple[str, bytes]]:
    rgb = Image.fromarray(smooth_rgb(SIDE))
    rgba = rgb.copy()
    rgba.putalpha(Image.fromarray((np.arange(SIDE * SIDE) % 251).astype(np.uint8).reshape(SIDE, SIDE)))
    palette = rgb.quantize(256)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: the transposed copy
    bomb = Image.new("P", (8192, 8192), 0)
    bomb.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    return {
        "rgb-png": ("image", encoded(rgb, "PNG", compress_level=1)),
        "rgba-png": ("image", encoded(rgba, "PNG", compress_level=1)),
        "palette-transparent-png": ("image", encoded(palette, "PNG", transparency=0, compress_level=1)),
        "grey-png": ("image", encoded(rgb.convert("L"), "PNG", compress_level=1)),
        "grey-alpha-png": ("image", encoded(rgba.convert("LA"), "PNG", compress_level=1)),
        "16-bit-png": ("image", encoded(Image.fromarray((smooth_rgb(SIDE)[..., 0].astype(np.uint16) * 257)), "PNG")),
        "jpeg": ("image", encoded(rgb, "JPEG", quality=85)),
        "progressive-444-jpeg": ("image", encoded(rgb, "JPEG", quality=85, progressive=True, subsampling=0)),
        "rotated-jpeg": ("image", encoded(rgb, "JPEG", quality=85, exif=exif)),
        "cmyk-jpeg": ("image", encoded(rgb.convert("CMYK"), "JPEG", quality=85)),
        # the bomb: 8192 x 8192 palette with transparency in a few kB
        "palette-bomb-png": ("image", encoded(bomb, "PNG", transparency=0, optimize=True)),
        "h264-480p": ("video", make_mp4(random_clip(30, 480, 640, seed=1) // 16 * 16, rate=10)),
        "mpeg4-720p": ("video", make_mp4(np.repeat(random_clip(1, 720, 1280, seed=2), 24, 0), rate=8, codec="mpeg4")),
    }


CHILD = """
import ctypes, gc, sys
from pathlib import Path
from lanes.vision.headers import Sampling
from lanes.vision.measure import decode_measured, measure_image, measure_video
from lanes.vision.qwen_image import IMAGE_DEFAULTS, VIDEO_DEFAULTS

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

for path in sys.argv[1:]:
    kind, data = Path(path).suffix[1:], Path(path).read_bytes()
    params = IMAGE_DEFAULTS if kind == "image" else VIDEO_DEFAULTS
    measured = measure_image(data, params) if kind == "image" else measure_video(data, params, Sampling())
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the last part freed goes back: its pages would hide this one's
    open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current resident size
    base = status("VmRSS")
    visual = decode_measured(measured, params, Sampling())
    assert visual.tokens == measured.tokens and visual.grid == measured.grid
    print(Path(path).stem, status("VmHWM") - base, measured.cost)
    del visual
"""


def test_a_parts_cost_bounds_what_decoding_it_holds(tmp_path):
    made = cases()
    paths = []
    for name, (kind, data) in made.items():
        paths.append(tmp_path / f"{name}.{kind}")
        paths[-1].write_bytes(data)
    lines = subprocess.run([sys.executable, "-c", CHILD, *map(str, paths)], capture_output=True, text=True,
                           timeout=300, check=True).stdout.splitlines()
    measured = {name: (int(peak), int(cost)) for name, peak, cost in (line.split() for line in lines)}
    assert set(measured) == set(made)
    for name, (peak, cost) in measured.items():
        assert peak <= cost <= 3 * peak + FIXED_COST, (name, peak >> 20, cost >> 20)
