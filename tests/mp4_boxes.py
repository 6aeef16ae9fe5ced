"""mp4 files built with av in memory, and their boxes found and rewritten by path (e.g.
"moov/trak/mdia/minf/stbl/stsz"), for tests that lie in a box. The walker here is the tests' own, not the
probe's. Rewriting a box moves what follows it: use it where nothing after it is pointed to (av writes
`moov` after `mdat`; fragments' data offsets count from their `moof`).
"""

from __future__ import annotations

import io
import struct

import av
import numpy as np

CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"dinf", b"edts", b"mvex", b"moof", b"traf", b"udta"}


def make_mp4(frames: np.ndarray, rate: int = 10, codec: str = "libx264", options: dict | None = None,
             audio: bool = False) -> bytes:
    """`frames` [T, H, W, 3] uint8 encoded as an mp4 in memory; `audio` adds a silent AAC track."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp4", options=options or {}) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.codec_context.thread_count = 1  # one encoder thread: the same frames always give the same stream
        sound = container.add_stream("aac", rate=8000) if audio else None
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            if sound is not None:
                silence = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.float32), format="fltp", layout="mono")
                silence.sample_rate = 8000
                container.mux(sound.encode(silence))
        container.mux(stream.encode())
        if sound is not None:
            container.mux(sound.encode())
    return out.getvalue()


def random_clip(count: int, height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def walk(data: bytes, start: int = 0, end: int | None = None, prefix: str = ""):
    """(path, offset, size) of every box, depth first, descending into the usual containers."""
    end = len(data) if end is None else end
    at = start
    while end - at >= 8:
        size, kind = struct.unpack_from(">I4s", data, at)
        head = 8
        if size == 1:
            size, head = struct.unpack_from(">Q", data, at + 8)[0], 16
        elif size == 0:
            size = end - at
        path = prefix + kind.decode("latin-1")
        yield path, at, size
        if kind in CONTAINERS:
            yield from walk(data, at + head, at + size, path + "/")
        at += size


def find(data: bytes, path: str, nth: int = 0) -> tuple[int, int]:
    """(offset, size) of the `nth` box at `path`."""
    found = [(at, size) for p, at, size in walk(data) if p == path]
    return found[nth]


def box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I4s", 8 + len(payload), kind) + payload


def full_box(kind: bytes, payload: bytes, version: int = 0, flags: int = 0) -> bytes:
    return box(kind, struct.pack(">I", version << 24 | flags) + payload)


def replaced(data: bytes, path: str, new: bytes, nth: int = 0) -> bytes:
    """`data` with the box at `path` replaced by `new` (whole box bytes), its parents' sizes fixed."""
    at, size = find(data, path, nth)
    out = bytearray(data[:at] + new + data[at + size:])
    _grow_parents(out, data, path, at, len(new) - size)
    return bytes(out)


def _grow_parents(out: bytearray, data: bytes, path: str, at: int, delta: int) -> None:
    parts = path.split("/")
    for depth in range(1, len(parts)):
        parent = "/".join(parts[:depth])
        for p, offset, size in walk(data):
            if p == parent and offset < at < offset + size:
                struct.pack_into(">I", out, offset, size + delta)


def patched(data: bytes, at: int, value: int, fmt: str = ">I") -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)
