"""Stream writers: processes of their own (`writer.py`) that write streamed answers to the clients' sockets,
so that the event loop running the lane core does not spend a system call on every token.

The server hands a streamed answer's socket to a writer once its head is written (a duplicate of the
descriptor), then its chunks as they come: what all of a writer's streams produce while the loop runs
goes out in one message (after a pass, one a pass), not one write a token. The connection stays the
server's: it reads the client (a client that leaves is seen at once), keeps the request's deadline, and
writes the next answer on a kept-alive connection once the writer says the last one is FLUSHED. A socket
that fills makes its stream wait (BEHIND until AHEAD), as a full socket does in the server itself; a
writer that dies ends its streams as a client that left would (GONE) and the server writes on alone.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import sys
from typing import Iterator

import trio

from . import wire

log = logging.getLogger("lanes.http")


class Relayed:
    """One streamed answer's writes through a writer: `write` never waits; `room` and `finish` do."""

    __slots__ = ("_link", "conn", "behind", "gone", "flushed", "_ended", "_changed")

    def __init__(self, link: "WriterLink", conn: int) -> None:
        self._link, self.conn = link, conn
        self.behind = self.gone = self.flushed = False
        self._ended = False  # END or DROP sent: nothing more goes to the writer
        self._changed = trio.Event()

    def write(self, data: bytes) -> None:
        self._link.push(wire.DATA, self.conn, data)

    async def room(self) -> None:
        """Until the writer has caught up with this socket, or it has gone."""
        while self.behind and not self.gone:
            await self._changed.wait()

    async def finish(self) -> None:
        """Until every byte given is written (FLUSHED), or the client has gone."""
        if not self._ended:
            self._ended = True
            self._link.push(wire.END, self.conn)
        while not (self.flushed or self.gone):
            await self._changed.wait()

    def drop(self) -> None:
        """Nothing more is written (the answer ended early): what waits in the writer is discarded."""
        if not self._ended:
            self._ended = True
            if not (self.flushed or self.gone):
                self._link.push(wire.DROP, self.conn)
        self._link.forget(self.conn)

    def note(self, kind: int) -> None:
        if kind == wire.BEHIND:
            self.behind = True
        elif kind == wire.AHEAD:
            self.behind = False
        elif kind == wire.FLUSHED:
            self.flushed = True
        else:
            self.gone = True
        self._changed.set()
        self._changed = trio.Event()


class WriterLink:
    """The server's end of one writer process: its queue of records, sent a batch at a time."""

    def __init__(self, control: trio.socket.SocketType, process: trio.Process) -> None:
        self._control, self.process = control, process
        self._queue: list[tuple[int, int, bytes | int]] = []
        self._wake = trio.Event()
        self._open: dict[int, Relayed] = {}
        self._next = 0
        self.alive = True
        self.messages = 0  # sent to the writer (bench/http_path.py compares them with the passes)

    def open(self, fd: int) -> Relayed:
        """Hand the socket `fd` to the writer; its own duplicate travels, so the connection may close ours."""
        conn, self._next = self._next, (self._next + 1) & 0xFFFFFFFF
        relayed = self._open[conn] = Relayed(self, conn)
        self.push(wire.OPEN, conn, os.dup(fd))
        return relayed

    def push(self, kind: int, conn: int, payload: bytes | int = b"") -> None:
        if not self.alive:
            return  # its answers have all been told GONE: nothing more reaches a writer that is lost
        self._queue.append((kind, conn, payload))
        self._wake.set()

    def forget(self, conn: int) -> None:
        self._open.pop(conn, None)

    async def send_loop(self) -> None:
        """Everything queued since the last send, in as few messages as it fits."""
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                queue, self._queue = self._queue, []
                messages = list(_messages(queue))
                for i, (message, fds) in enumerate(messages):
                    self.messages += 1
                    try:
                        if fds:
                            await self._control.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                                     array.array("i", fds))])
                        else:
                            await self._control.send(message)
                    except BaseException:
                        for _, unsent in messages[i + 1:]:
                            self._queue.extend((wire.OPEN, 0, fd) for fd in unsent)  # closed below
                        raise
                    finally:
                        for fd in fds:
                            os.close(fd)  # the writer has its own now (or never will)
        except OSError:
            self._lost()
        finally:
            for kind, _, fd in self._queue:
                if kind == wire.OPEN:
                    os.close(fd)
            self._queue = []

    async def read_loop(self) -> None:
        try:
            while True:
                data = await self._control.recv(65536)
                if not data:
                    break
                for kind, conn in wire.replies(data):
                    relayed = self._open.get(conn)
                    if relayed is not None:
                        relayed.note(kind)
                        if kind in (wire.FLUSHED, wire.GONE):
                            del self._open[conn]
        except OSError:
            pass
        self._lost()

    def _lost(self) -> None:
        if self.alive:  # the server's own close cancels the loops first: this is a writer lost under way
            self.alive = False
            log.error("stream writer %d stopped answering (exit status %s): its streams end, the server writes "
                      "on alone", self.process.pid, self.process.returncode)
        for relayed in self._open.values():
            relayed.note(wire.GONE)
        self._open.clear()
        self._wake.set()  # the send loop ends

    def close(self) -> None:
        self._control.close()


def _messages(queue: list[tuple[int, int, bytes | int]]) -> Iterator[tuple[bytes, list[int]]]:
    """The queue's records packed into messages of at most `wire.MESSAGE` bytes and `wire.MOST_FDS` descriptors."""
    parts: list[bytes] = []
    fds: list[int] = []
    size, most = 0, wire.MESSAGE - wire.RECORD.size  # a record's payload at most
    for kind, conn, payload in queue:
        pieces = [b""] if kind != wire.DATA else [payload[at:at + most] for at in range(0, len(payload), most)]
        for piece in pieces:
            record = wire.record(kind, conn, piece)
            if parts and (size + len(record) > wire.MESSAGE or (kind == wire.OPEN and len(fds) == wire.MOST_FDS)):
                yield b"".join(parts), fds
                parts, fds, size = [], [], 0
            parts.append(record)
            size += len(record)
            if kind == wire.OPEN:
                fds.append(payload)
    if parts:
        yield b"".join(parts), fds


class StreamWriters:
    """`count` writer processes, started by `run` and ended when `close` is called (after the server)."""

    def __init__(self, count: int, send_timeout: float) -> None:
        self.count, self.send_timeout = count, send_timeout
        self.links: list[WriterLink] = []
        self._turn = 0
        self._closed = trio.Event()

    def open(self, fd: int) -> Relayed | None:
        """A writer for the socket `fd`, in turn; None when none is alive (the server writes itself)."""
        for _ in range(len(self.links)):
            link = self.links[self._turn % len(self.links)]
            self._turn += 1
            if link.alive:
                return link.open(fd)
        return None

    @property
    def pids(self) -> list[int]:
        return [link.process.pid for link in self.links]

    def close(self) -> None:
        self._closed.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(self.count):
                    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    with theirs:
                        process = await trio.lowlevel.open_process(
                            [sys.executable, "-m", "lanes.http.writer", str(theirs.fileno()), repr(self.send_timeout)],
                            pass_fds=(theirs.fileno(),))
                    link = WriterLink(trio.socket.from_stdlib_socket(ours), process)
                    self.links.append(link)
                    nursery.start_soon(link.send_loop)
                    nursery.start_soon(link.read_loop)
                task_status.started(self)
                await self._closed.wait()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                for link in self.links:
                    link.close()  # the writer sees its end close and exits
                for link in self.links:
                    with trio.move_on_after(2.0):
                        await link.process.wait()
                    if link.process.returncode is None:
                        link.process.kill()
                        await link.process.wait()
