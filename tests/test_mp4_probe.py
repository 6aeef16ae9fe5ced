"""The mp4 probe: honest files described and decoded exactly as before, and every lying box refused by its
code before FFmpeg reads a byte of it.

Rules: every file is made here with av in memory, then rewritten box by box (tests/mp4_boxes.py, a walker
of the tests' own); the reference for frames is av decoding the original bytes. The memory test runs the
bombs in a child process with an address-space limit and reads its peak resident memory from /proc.
"""

import io
import struct
import subprocess
import sys

import av
import numpy as np
import pytest

from lanes.vision.errors import MediaRejected
from lanes.vision.headers import MAX_FRAME_PIXELS, MAX_TOTAL_FRAMES
from lanes.vision.mp4_probe import MAX_BOXES, probe_mp4
from mp4_boxes import box, find, full_box, make_mp4, patched, random_clip, replaced, walk

STBL = "moov/trak/mdia/minf/stbl"
PLAIN = make_mp4(random_clip(30, seed=1))  # ftyp, free, mdat, moov: B-frames, so ctts and stss too
FRAGMENTED = make_mp4(random_clip(30, seed=2), options={"movflags": "frag_keyframe+empty_moov"})
EVERY_FRAME = make_mp4(random_clip(8, seed=3), options={"movflags": "empty_moov+frag_every_frame"})
WITH_AUDIO = make_mp4(random_clip(10, seed=4), audio=True)

def hidden_trun() -> bytes:
    """FRAGMENTED with its udta replaced by one of the same size holding a tfhd and a trun bomb (FFmpeg's
    parser runs any box type it knows wherever it is; the same size keeps every offset)."""
    bomb = full_box(b"tfhd", struct.pack(">I", 1)) + full_box(b"trun", struct.pack(">I", 0x5000000))
    size = find(FRAGMENTED, "moov/udta")[1]
    return replaced(FRAGMENTED, "moov/udta", box(b"udta", bomb + box(b"free", bytes(size - 16 - len(bomb)))))


HIDDEN_TRUN = hidden_trun()


def sps_lie() -> bytes:
    """Two black 8192 x 4320 frames whose sample entry says 16 x 16: only the bitstream tells the truth."""
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=1, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = 8192, 4320, "yuv420p"
        frame = av.VideoFrame(8192, 4320, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        for _ in range(2):
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    data = out.getvalue()
    return patched(data, at(data, f"{STBL}/stsd", 16 + 32), 16 << 16 | 16)


def probe(data: bytes, max_samples: int = MAX_TOTAL_FRAMES):
    return probe_mp4(data, max_samples=max_samples, max_pixels=MAX_FRAME_PIXELS)


def refused(code: str, data: bytes, **limits) -> None:
    with pytest.raises(MediaRejected) as caught:
        probe(data, **limits)
    assert caught.value.code == code


def frames_of(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data), format="mp4") as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]


def at(data: bytes, path: str, offset: int) -> int:
    return find(data, path)[0] + offset


def trun_bomb(flags: int) -> bytes:
    """FRAGMENTED with its trun declaring 0x5000000 samples, as the issue's 1,357-byte file does."""
    trun = find(FRAGMENTED, "moof/traf/trun")[0]
    return patched(patched(FRAGMENTED, trun + 8, flags), trun + 12, 0x5000000)


# --- honest files ---

@pytest.mark.parametrize("name, data, samples", [
    ("plain", PLAIN, 30), ("fragmented", FRAGMENTED, 30), ("a fragment a frame", EVERY_FRAME, 8),
    ("with audio", WITH_AUDIO, 10),
])
def test_an_honest_mp4_is_described_and_decodes_as_before(name, data, samples):
    facts = probe(data)
    assert (facts.codec, facts.width, facts.height, facts.samples) == ("avc1", 64, 48, samples)
    assert facts.fragmented == (data is not PLAIN and data is not WITH_AUDIO)
    assert len(facts.data) == len(data)
    ours, theirs = frames_of(facts.data), frames_of(data)
    assert len(ours) == samples and all(np.array_equal(a, b) for a, b in zip(ours, theirs))


def test_ffmpeg_is_given_the_video_track_alone():
    facts = probe(WITH_AUDIO)
    top = [path for path, _, _ in walk(facts.data) if path.count("/") <= 1]
    # the free box, the audio track and udta become skip; the video track's tree is untouched
    assert top == ["ftyp", "skip", "mdat", "moov", "moov/mvhd", "moov/trak", "moov/skip", "moov/skip"]
    with av.open(io.BytesIO(facts.data), format="mp4") as container:
        assert len(container.streams) == 1 and len(container.streams.video) == 1


def test_fragments_keep_only_what_ffmpeg_needs():
    paths = [path for path, _, _ in walk(probe(FRAGMENTED).data)]
    # udta, mfhd (FFmpeg has no use for it) and mfra become skip
    assert paths[-9:] == ["moov/skip", "moof", "moof/skip", "moof/traf", "moof/traf/tfhd", "moof/traf/tfdt",
                          "moof/traf/trun", "mdat", "skip"]


def test_a_trun_hidden_where_ffmpeg_would_parse_it_is_hidden_from_it():
    # FFmpeg's parser runs any box type it knows wherever it is: a tfhd and a trun bomb inside udta
    facts = probe(HIDDEN_TRUN)
    assert [path for path, _, _ in walk(facts.data) if path.startswith("moov/")][-1] == "moov/skip"
    assert all(np.array_equal(a, b) for a, b in zip(frames_of(facts.data), frames_of(FRAGMENTED)))


def test_a_last_box_of_size_zero_runs_to_the_end_and_a_short_tail_is_skipped():
    moov = find(PLAIN, "moov")[0]
    assert probe(patched(PLAIN, moov, 0)).samples == 30
    assert probe(PLAIN + b"\0\0\0\0").samples == 30


def test_the_frame_limit_counts_every_fragment():
    assert probe(EVERY_FRAME, max_samples=8).samples == 8
    refused("video_too_long", EVERY_FRAME, max_samples=7)


# --- lies ---

def stsz_constant(sample_size: int, count: int) -> bytes:
    return replaced(PLAIN, f"{STBL}/stsz", full_box(b"stsz", struct.pack(">II", sample_size, count)))


LIES = {
    # the file: 0x5000000 samples of 8 bytes each in a 264-byte trun
    "trun-count-over-its-box": ("video_malformed", lambda: trun_bomb(0xA05)),
    # no per-sample fields: the count alone, backed by no bytes at the trex's default size
    "trun-count-the-file-cannot-back": ("video_malformed", lambda: trun_bomb(0x1)),
    "stsz-count-over-the-frame-limit": ("video_too_long", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stsz", 16),
                                                                           MAX_TOTAL_FRAMES + 1)),
    "stsz-table-over-its-box": ("video_malformed", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stsz", 16), 1000)),
    "stsz-constant-size-past-the-file": ("video_malformed", lambda: stsz_constant(10_000, MAX_TOTAL_FRAMES)),
    "stts-entries-over-its-box": ("video_malformed", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stts", 12), 1000)),
    "stts-samples-over-the-frame-limit": ("video_too_long", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stts", 16),
                                                                             MAX_TOTAL_FRAMES + 1)),
    "stts-entries-over-the-frame-limit": ("video_too_long", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stts", 12),
                                                                             0xFFFFFFFF)),
    "ctts-entries-over-its-box": ("video_malformed", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/ctts", 12), 1000)),
    "stss-entries-over-its-box": ("video_malformed", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stss", 12), 1000)),
    "stsc-entries-over-its-box": ("video_malformed", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stsc", 12), 1000)),
    "stco-entries-over-its-box": ("video_malformed", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stco", 12), 1000)),
    "elst-over-the-edit-limit": ("video_malformed", lambda: replaced(PLAIN, "moov/trak/edts/elst", full_box(
        b"elst", struct.pack(">I", 17) + struct.pack(">IiI", 1000, 0, 0x10000) * 17))),
    "stsd-without-entries": ("video_malformed", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stsd", 12), 0)),
    "stsd-with-too-many-entries": ("video_malformed", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stsd", 12), 5)),
    "palette-depth": ("video_malformed", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stsd", 16 + 82), 8, ">H")),
    "traf-without-tfhd-first": ("video_malformed", lambda: patched(FRAGMENTED, at(FRAGMENTED, "moof/traf/tfhd", 4),
                                                                   int.from_bytes(b"tfhX", "big"))),
    "too-many-boxes": ("video_malformed", lambda: PLAIN + box(b"free", b"") * MAX_BOXES),
    "a-64-bit-size-past-its-parent": ("video_unreadable", lambda: replaced(PLAIN, f"{STBL}/stco", struct.pack(
        ">I4sQ", 1, b"stco", 1 << 40) + bytes(8))),
    "a-box-past-the-end-of-the-file": ("video_unreadable", lambda: PLAIN[:-10]),
    "a-size-below-its-header": ("video_unreadable", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stss", 0), 4)),
    "unknown-codec": ("video_codec", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stsd", 20), int.from_bytes(b"zzzz", "big"))),
    "no-sample-description": ("video_codec", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stsd", 4),
                                                             int.from_bytes(b"stsX", "big"))),
    "declared-frame-over-the-pixel-limit": ("video_too_large", lambda: patched(PLAIN, at(PLAIN, f"{STBL}/stsd", 16 + 32),
                                                                               8192 << 16 | 8192)),
    "no-moov": ("video_unreadable", lambda: patched(PLAIN, at(PLAIN, "moov", 4), int.from_bytes(b"moox", "big"))),
}


@pytest.mark.parametrize("name", LIES)
def test_a_lie_is_refused_by_its_code(name):
    code, make = LIES[name]
    refused(code, make())


def other_container(fmt: str) -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for frame in random_clip(4, 32, 32):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


@pytest.mark.parametrize("data", [other_container("matroska"), other_container("avi"), b"", b"hello" * 100,
                                  bytes(64), b"\x89PNG\r\n\x1a\n" + bytes(40)])
def test_what_is_not_an_mp4_is_unreadable(data):
    refused("video_unreadable", data)


# --- memory ---

CHILD = """
import resource, sys
from pathlib import Path
from lanes.vision.decode import decode_video
from lanes.vision.errors import MediaRejected

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

base = status("VmHWM")
raw = Path(sys.argv[1]).read_bytes()
codes = []
for path in sys.argv[2:]:
    try:
        decode_video(Path(path).read_bytes())
        codes.append("decoded")
    except MediaRejected as error:
        codes.append(error.code)
peak = status("VmHWM") - base
# the raw bomb straight into av, under a limit of 1 GiB more address space: it cannot open (or is refused)
limit = status("VmSize") + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import av, io
try:
    with av.open(io.BytesIO(raw), format="mp4") as container:
        sum(1 for _ in container.decode(container.streams.video[0]))
    raw_result = "opened"
except MemoryError:
    raw_result = "MemoryError"
except av.error.FFmpegError as error:
    raw_result = type(error).__name__
print(peak, raw_result, *codes)
"""


def test_bombs_cost_the_decoding_process_nothing(tmp_path):
    # the last: FFmpeg's stream-finding decode in av.open took +91 MiB for its 35 Mpx frame before max_pixels reached it
    bombs = [trun_bomb(0xA05), trun_bomb(0x1), stsz_constant(1, MAX_TOTAL_FRAMES + 1), HIDDEN_TRUN, sps_lie()]
    paths = []
    for i, data in enumerate(bombs):
        paths.append(tmp_path / f"bomb{i}.mp4")
        paths[-1].write_bytes(data)
    out = subprocess.run([sys.executable, "-c", CHILD, str(paths[1]), *map(str, paths)], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    peak, raw_result, codes = int(out[0]), out[1], out[2:]
    assert codes == ["video_malformed", "video_malformed", "video_too_long", "decoded", "video_too_large"]
    assert peak < 64 << 20, peak  # the probed bombs: under 64 MiB of peak resident memory, all five
    # the same trun bomb given to av as it is: some FFmpeg builds want more than 1 GiB for it, others refuse it
    assert raw_result in ("MemoryError", "InvalidDataError"), raw_result
