"""The records the server and its stream writers (`writer.py`) exchange over a SOCK_SEQPACKET pair."""

from __future__ import annotations

import struct
from typing import Iterator

RECORD = struct.Struct("<BII")  # kind, connection, payload bytes: the server's records
REPLY = struct.Struct("<BI")  # kind, connection: the writer's
MESSAGE = 64 << 10  # bytes a message holds at most, records and all (a pass's chunks for a writer, split if more)
MOST_FDS = 64  # descriptors a message carries at most

OPEN, DATA, END, DROP = 1, 2, 3, 4  # the server's kinds (OPEN's descriptor rides in the message's SCM_RIGHTS)
FLUSHED, GONE, BEHIND, AHEAD = 1, 2, 3, 4  # the writer's


def record(kind: int, conn: int, payload: bytes = b"") -> bytes:
    return RECORD.pack(kind, conn, len(payload)) + payload


def records(data: bytes) -> Iterator[tuple[int, int, bytes]]:
    view, at = memoryview(data), 0
    while at < len(view):
        kind, conn, size = RECORD.unpack_from(view, at)
        at += RECORD.size
        yield kind, conn, bytes(view[at:at + size])
        at += size


def reply(kind: int, conn: int) -> bytes:
    return REPLY.pack(kind, conn)


def replies(data: bytes) -> Iterator[tuple[int, int]]:
    for at in range(0, len(data) - len(data) % REPLY.size, REPLY.size):
        yield REPLY.unpack_from(data, at)
