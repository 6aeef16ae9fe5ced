"""An mp4 (ISO BMFF) read in pure Python before FFmpeg sees it, and the bytes FFmpeg is then given.

FFmpeg's mov demuxer allocates by the counts that boxes declare (a `trun`'s or an `stsz`'s sample count)
before it reads the entries, and it parses every box type it knows wherever it finds one. So the probe
walks the tree itself: it keeps the first video track and only the boxes FFmpeg needs to decode it, checks
every count those boxes declare against the bytes that hold them and against the frame limit, and renames
every other box `skip` (a type FFmpeg does not know: it skips it by its size). FFmpeg then reads only
boxes whose costs were checked here. Offsets do not move, so sample data stays where the tables say.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

from lanes.vision.errors import MediaRejected

SKIP = b"skip"
# Each kept box's children that FFmpeg is given (b"" is the file); every other child becomes SKIP.
KEPT: dict[bytes, frozenset[bytes]] = {
    b"": frozenset({b"ftyp", b"moov", b"mdat", b"moof"}),
    b"moov": frozenset({b"mvhd", b"trak", b"mvex"}),
    b"trak": frozenset({b"tkhd", b"edts", b"mdia"}),
    b"edts": frozenset({b"elst"}),
    b"mdia": frozenset({b"mdhd", b"hdlr", b"minf"}),
    b"minf": frozenset({b"vmhd", b"dinf", b"stbl"}),
    b"dinf": frozenset({b"dref"}),
    b"stbl": frozenset({b"stsd", b"stts", b"ctts", b"stss", b"stsc", b"stsz", b"stz2", b"stco", b"co64"}),
    b"mvex": frozenset({b"trex"}),
    b"moof": frozenset({b"traf"}),
    b"traf": frozenset({b"tfhd", b"tfdt", b"trun"}),
}
# Codecs av decodes here, by their sample entry's type; a sample entry's children FFmpeg is given.
VIDEO_CODECS = frozenset({b"avc1", b"avc3", b"hvc1", b"hev1", b"av01", b"vp09", b"mp4v"})
ENTRY_KEPT = frozenset({b"avcC", b"hvcC", b"av1C", b"vpcC", b"esds", b"pasp", b"colr", b"fiel", b"btrt"})
# Box types an mp4 may begin with; anything else is not an mp4.
FIRST = frozenset({b"ftyp", b"styp", b"moov", b"mdat", b"free", b"skip", b"wide"})
# A fragment a frame for ten minutes at 30 fps, audio beside it, is ~200k boxes; walking 256k takes ~0.5 s.
MAX_BOXES = 1 << 18
MAX_EDITS = 16  # honest edit lists hold one or two entries; FFmpeg rebuilds the index once an entry
MAX_DESCRIPTIONS = 4  # sample descriptions in one stsd
VISUAL_ENTRY = 86  # a visual sample entry's fixed fields end here (ISO 14496-12 8.5.2): its children follow
# trun's optional per-sample fields (duration, size, flags, composition offset), 4 bytes each
TRUN_SAMPLE_FIELDS = (0x100, 0x200, 0x400, 0x800)


@dataclass(frozen=True, eq=False)
class Mp4Probe:
    """What the boxes of an mp4 declare about its first video track, and the bytes FFmpeg may read."""

    data: bytes  # the file with every box outside the video track's tree renamed `skip`
    codec: str  # the sample entry's type, e.g. "avc1"
    width: int  # as the sample entry declares it (the bitstream may differ; the decoder is bounded too)
    height: int
    samples: int  # declared samples: the sample tables' count plus every fragment's
    fragmented: bool


class Box(NamedTuple):
    kind: bytes
    at: int
    head: int  # header bytes: 8, or 16 with a 64-bit size
    size: int

    @property
    def start(self) -> int:
        return self.at + self.head

    @property
    def end(self) -> int:
        return self.at + self.size


def probe_mp4(data: bytes, *, max_samples: int, max_pixels: int) -> Mp4Probe:
    """The first video track's facts and the bytes FFmpeg may read, or a refusal before FFmpeg reads any.

    Raises `MediaRejected`: video_unreadable (not an mp4, or boxes that overrun their parent or the file),
    video_malformed (a count its box cannot hold or the file's bytes cannot back, or past a structural
    limit), video_no_stream, video_codec, video_too_long (more than `max_samples` declared),
    video_too_large (a declared frame over `max_pixels`).
    """
    return _Probe(bytearray(data), max_samples, max_pixels).run()


class _Probe:
    def __init__(self, buf: bytearray, max_samples: int, max_pixels: int) -> None:
        self.buf = buf
        self.max_samples = max_samples
        self.max_pixels = max_pixels
        self.boxes = 0
        self.track_id = -1
        self.trex_size = 0  # the video track's default sample size for fragments (its trex)
        self.table_samples = 0
        self.fragment_samples = 0
        self.entries: list[tuple[bytes, int, int]] = []  # (codec, width, height) of each sample entry

    def run(self) -> Mp4Probe:
        top = self.children(0, len(self.buf))
        if not top or top[0].kind not in FIRST:
            raise MediaRejected("video_unreadable")
        moovs = [box for box in top if box.kind == b"moov"]
        if not moovs:
            raise MediaRejected("video_unreadable")
        for box in top:
            if box.kind not in KEPT[b""] or (box.kind == b"moov" and box is not moovs[0]):
                self.rename(box)
        self.movie(moovs[0])
        for box in top:
            if box.kind == b"moof":
                self.fragment(box)
        samples = self.table_samples + self.fragment_samples
        if samples > self.max_samples:
            raise MediaRejected("video_too_long")
        codec, width, height = self.entries[0]
        return Mp4Probe(bytes(self.buf), codec.decode("latin-1"), width, height, samples, self.fragment_samples > 0)

    # --- the box tree ---

    def children(self, start: int, end: int) -> list[Box]:
        """The boxes tiling [start, end); fewer than 8 bytes left at the end are skipped, as FFmpeg does."""
        out = []
        at = start
        while end - at >= 8:
            size, kind = struct.unpack_from(">I4s", self.buf, at)
            head = 8
            if size == 1:
                if end - at < 16:
                    raise MediaRejected("video_unreadable")
                size, head = struct.unpack_from(">Q", self.buf, at + 8)[0], 16
            elif size == 0:
                size = end - at  # to the end of its parent, as FFmpeg reads it
            if size < head or size > end - at:
                raise MediaRejected("video_unreadable")
            self.boxes += 1
            if self.boxes > MAX_BOXES:
                raise MediaRejected("video_malformed")
            out.append(Box(kind, at, head, size))
            at += size
        return out

    def rename(self, box: Box) -> None:
        self.buf[box.at + 4:box.at + 8] = SKIP

    def child(self, box: Box, kind: bytes) -> Box | None:
        return next((c for c in self.children(box.start, box.end) if c.kind == kind), None)

    def payload(self, box: Box, need: int) -> int:
        """Where `box`'s payload starts, once it is known to hold at least `need` bytes."""
        if box.size - box.head < need:
            raise MediaRejected("video_malformed")
        return box.start

    def u32(self, at: int) -> int:
        return struct.unpack_from(">I", self.buf, at)[0]

    def keep(self, box: Box) -> None:
        """Walk a kept container: children it may hold are checked and walked, the others renamed."""
        for child in self.children(box.start, box.end):
            if child.kind not in KEPT[box.kind]:
                self.rename(child)
                continue
            check = _CHECKS.get(child.kind)
            if check is not None:
                check(self, child)
            if child.kind in KEPT:
                self.keep(child)

    # --- the movie and its video track ---

    def movie(self, moov: Box) -> None:
        video = None
        for box in self.children(moov.start, moov.end):
            if box.kind == b"trak" and video is None and self.handler(box) == b"vide":
                video = box
            elif box.kind == b"trak":
                self.rename(box)
        if video is None:
            raise MediaRejected("video_no_stream")
        tkhd = self.child(video, b"tkhd")
        if tkhd is None:
            raise MediaRejected("video_unreadable")
        at = self.payload(tkhd, 24)
        self.track_id = self.u32(at + (20 if self.buf[at] == 1 else 12))
        for box in self.children(moov.start, moov.end):
            if box.kind == b"mvex":
                self.extends(box)
            elif box.kind not in KEPT[b"moov"]:
                self.rename(box)
            elif box.kind == b"trak" and box.at == video.at:
                self.keep(box)
        if not self.entries:
            raise MediaRejected("video_codec")  # a video track with no sample description has no codec

    def handler(self, trak: Box) -> bytes | None:
        mdia = self.child(trak, b"mdia")
        hdlr = None if mdia is None else self.child(mdia, b"hdlr")
        if hdlr is None:
            return None
        return bytes(self.buf[self.payload(hdlr, 12) + 8:hdlr.start + 12])

    def extends(self, mvex: Box) -> None:
        for box in self.children(mvex.start, mvex.end):
            if box.kind != b"trex" or self.u32(self.payload(box, 24) + 4) != self.track_id:
                self.rename(box)
            else:
                self.trex_size = self.u32(box.start + 16)

    def descriptions(self, stsd: Box) -> None:
        at = self.payload(stsd, 8)
        count = self.u32(at + 4)
        if not 1 <= count <= MAX_DESCRIPTIONS:
            raise MediaRejected("video_malformed")
        entries = self.children(at + 8, stsd.end)
        if len(entries) < count:
            raise MediaRejected("video_malformed")
        for entry in entries[:count]:
            if entry.kind not in VIDEO_CODECS:
                raise MediaRejected("video_codec")
            if self.u32(entry.at) != entry.size or entry.size < VISUAL_ENTRY:  # FFmpeg reads 32-bit sizes only
                raise MediaRejected("video_malformed")
            width, height = struct.unpack_from(">HH", self.buf, entry.at + 32)
            depth = struct.unpack_from(">H", self.buf, entry.at + 82)[0]
            if depth & 0x1F in (1, 2, 4, 8):
                raise MediaRejected("video_malformed")  # FFmpeg would read a palette where we read children
            if width * height > self.max_pixels:
                raise MediaRejected("video_too_large")
            self.entries.append((entry.kind, width, height))
            for child in self.children(entry.at + VISUAL_ENTRY, entry.end):
                if child.kind not in ENTRY_KEPT:
                    self.rename(child)

    # --- sample tables: every count fits its box, and the file's bytes can back the samples ---

    def table(self, box: Box, entry: int, prefix: int = 8) -> int:
        """The entry count of a full box `[version, flags, count, entries...]`, checked to fit."""
        at = self.payload(box, prefix)
        count = self.u32(at + prefix - 4)
        if count > self.max_samples:
            raise MediaRejected("video_too_long")  # every entry stands for at least one sample
        if prefix + count * entry > box.size - box.head:
            raise MediaRejected("video_malformed")
        return count

    def times(self, box: Box) -> None:
        count = self.table(box, 8)
        at = box.start + 8
        declared = sum(n for n, _ in struct.iter_unpack(">II", self.buf[at:at + 8 * count]))
        self.samples_declared(declared)

    def sizes(self, box: Box) -> None:
        at = self.payload(box, 12)
        size, count = struct.unpack_from(">II", self.buf, at + 4)
        self.samples_declared(count)
        if size == 0:
            self.table(box, 4, prefix=12)
            total = sum(s for (s,) in struct.iter_unpack(">I", self.buf[at + 12:at + 12 + 4 * count]))
        else:
            total = size * count
        if total > len(self.buf):
            raise MediaRejected("video_malformed")  # more sample bytes than the whole file

    def compact_sizes(self, box: Box) -> None:
        at = self.payload(box, 12)
        field, count = self.buf[at + 7], self.u32(at + 8)
        self.samples_declared(count)
        if field not in (4, 8, 16) or 12 + (count * field + 7) // 8 > box.size - box.head:
            raise MediaRejected("video_malformed")

    def edits(self, box: Box) -> None:
        at = self.payload(box, 8)
        if self.u32(at + 4) > MAX_EDITS:
            raise MediaRejected("video_malformed")
        self.table(box, 20 if self.buf[at] == 1 else 12)

    def samples_declared(self, count: int) -> None:
        if count > self.max_samples:
            raise MediaRejected("video_too_long")
        self.table_samples = max(self.table_samples, count)

    # --- fragments ---

    def fragment(self, moof: Box) -> None:
        for box in self.children(moof.start, moof.end):
            if box.kind != b"traf":
                self.rename(box)
                continue
            kids = self.children(box.start, box.end)
            if not kids or kids[0].kind != b"tfhd":
                raise MediaRejected("video_malformed")  # FFmpeg would file its runs under another track
            at = self.payload(kids[0], 8)
            if self.u32(at + 4) != self.track_id:
                self.rename(box)
                continue
            default_size = self.default_size(kids[0])
            for kid in kids:
                if kid.kind == b"trun":
                    self.run_of_samples(kid, default_size)
                elif kid.kind not in KEPT[b"traf"] or (kid.kind == b"tfhd" and kid is not kids[0]):
                    self.rename(kid)

    def default_size(self, tfhd: Box) -> int:
        at = tfhd.start
        flags = int.from_bytes(self.buf[at + 1:at + 4], "big")
        # base data offset, sample description, duration, size, flags: present as the flags say, in this order
        fields = [(0x1, 8), (0x2, 4), (0x8, 4), (0x10, 4), (0x20, 4)]
        offset = 8
        size = self.trex_size
        for flag, width in fields:
            if flags & flag:
                self.payload(tfhd, offset + width)
                if flag == 0x10:
                    size = self.u32(at + offset)
                offset += width
        return size

    def run_of_samples(self, trun: Box, default_size: int) -> None:
        at = self.payload(trun, 8)
        flags = int.from_bytes(self.buf[at + 1:at + 4], "big")
        count = self.u32(at + 4)
        head = 8 + 4 * bool(flags & 0x1) + 4 * bool(flags & 0x4)
        per_sample = 4 * sum(bool(flags & f) for f in TRUN_SAMPLE_FIELDS)
        if head + count * per_sample > trun.size - trun.head:
            raise MediaRejected("video_malformed")
        if flags & 0x200:
            rows = self.buf[at + head:at + head + count * per_sample]
            column = [flag for flag in TRUN_SAMPLE_FIELDS if flags & flag].index(0x200)
            total = sum(row[column] for row in struct.iter_unpack(">" + "I" * (per_sample // 4), rows))
        else:
            total = count * max(default_size, 1)  # a sample of no bytes is refused by FFmpeg, after it allocates
        if total > len(self.buf):
            raise MediaRejected("video_malformed")  # more sample bytes than the whole file
        self.fragment_samples += count
        if self.fragment_samples > self.max_samples:
            raise MediaRejected("video_too_long")


_CHECKS = {
    b"stsd": _Probe.descriptions,
    b"stts": _Probe.times,
    b"ctts": lambda probe, box: probe.table(box, 8),
    b"stss": lambda probe, box: probe.table(box, 4),
    b"stsc": lambda probe, box: probe.table(box, 12),
    b"stco": lambda probe, box: probe.table(box, 4),
    b"co64": lambda probe, box: probe.table(box, 8),
    b"stsz": _Probe.sizes,
    b"stz2": _Probe.compact_sizes,
    b"elst": _Probe.edits,
}
