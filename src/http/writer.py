"""A stream writer process: it writes streamed answers' bytes to their clients' sockets for the server process.

    python -m lanes.http.writer FD SEND_TIMEOUT

FD is its end of a SOCK_SEQPACKET pair with the server. Each message from the server holds records
(`wire.RECORD`: kind, connection, length, bytes): OPEN carries the client socket's descriptor (SCM_RIGHTS),
DATA bytes to write in order, END asks for FLUSHED once all is written (the descriptor is then closed),
DROP discards what waits. It answers in records of its own: BEHIND when a socket takes less than it is
given (the server's stream then waits, as it waits on a full socket itself), AHEAD once it has caught
up, FLUSHED, and GONE when the client has left or took nothing for SEND_TIMEOUT seconds. It exits when
the server's end closes. No part of lanes is imported: the process stays small and starts fast.
"""

from __future__ import annotations

import array
import os
import resource
import selectors
import signal
import socket
import sys
import time

from . import wire


class Client:
    __slots__ = ("fd", "pending", "ending", "behind", "since", "watched")

    def __init__(self, fd: int) -> None:
        self.fd, self.pending = fd, bytearray()
        self.ending = self.behind = self.watched = False
        self.since = 0.0  # when it last took bytes, while some wait


class Writer:
    def __init__(self, control: socket.socket, send_timeout: float) -> None:
        self.control, self.send_timeout = control, send_timeout
        self.clients: dict[int, Client] = {}
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ, None)
        self.replies: list[bytes] = []

    def run(self) -> None:
        while True:
            for key, _ in self.selector.select(self._timeout()):
                if key.data is None:
                    if not self._read():
                        return
                else:
                    self._flush(key.data, self.clients.get(key.data))
            self._stalls()
            self._reply()

    def _read(self) -> bool:
        """Every message waiting from the server; False once its end has closed."""
        while True:
            fds = array.array("i")
            try:
                data, ancillary, flags, _ = self.control.recvmsg(wire.MESSAGE,
                                                                 socket.CMSG_SPACE(wire.MOST_FDS * fds.itemsize))
            except BlockingIOError:
                return True
            if not data:
                return False
            if flags & socket.MSG_TRUNC:  # larger than the server may send: its records cannot be trusted
                raise SystemExit(f"stream writer {os.getpid()}: a message of more than {wire.MESSAGE} bytes")
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            touched = self._apply(data, list(fds))
            for conn in touched:
                self._flush(conn, self.clients.get(conn))

    def _apply(self, data: bytes, fds: list[int]) -> list[int]:
        touched: dict[int, None] = {}  # each connection once, in order: a pass's many records flush it once
        for kind, conn, payload in wire.records(data):
            client = self.clients.get(conn)
            if kind == wire.OPEN:
                if not fds:  # not installed here (out of descriptors): the stream ends as if its client had left
                    self._say(wire.GONE, conn)
                    print(f"stream writer {os.getpid()}: a socket handed over did not arrive", file=sys.stderr)
                    continue
                self.clients[conn] = Client(fds.pop(0))
            elif client is None:
                continue  # a client already gone (its GONE crossed this on the way)
            elif kind == wire.DATA:
                client.pending += payload
            elif kind == wire.END:
                client.ending = True
            elif kind == wire.DROP:
                self._forget(conn, client)
                continue
            touched[conn] = None
        return list(touched)

    def _flush(self, conn: int, client: Client | None) -> None:
        if client is None:
            return
        pending = client.pending
        try:
            while pending:
                written = os.write(client.fd, pending)
                del pending[:written]
                client.since = time.monotonic()
        except BlockingIOError:
            pass
        except OSError:  # reset, broken pipe: the client has left
            self._say(wire.GONE, conn)
            self._forget(conn, client)
            return
        if pending:
            if not client.behind:
                client.behind, client.since = True, time.monotonic()
                self._say(wire.BEHIND, conn)
            if not client.watched:
                client.watched = True
                self.selector.register(client.fd, selectors.EVENT_WRITE, conn)
            return
        if client.watched:
            client.watched = False
            self.selector.unregister(client.fd)
        if client.behind:
            client.behind = False
            self._say(wire.AHEAD, conn)
        if client.ending:
            self._say(wire.FLUSHED, conn)
            self._forget(conn, client)

    def _timeout(self) -> float | None:
        waiting = [c.since for c in self.clients.values() if c.pending]
        return None if not waiting else max(0.0, min(waiting) + self.send_timeout - time.monotonic())

    def _stalls(self) -> None:
        now = time.monotonic()
        for conn, client in list(self.clients.items()):
            if client.pending and now - client.since >= self.send_timeout:
                self._say(wire.GONE, conn)  # the client stopped reading
                self._forget(conn, client)

    def _forget(self, conn: int, client: Client) -> None:
        if client.watched:
            self.selector.unregister(client.fd)
        os.close(client.fd)
        del self.clients[conn]

    def _say(self, kind: int, conn: int) -> None:
        self.replies.append(wire.reply(kind, conn))

    def _reply(self) -> None:
        if self.replies:
            message, self.replies = b"".join(self.replies), []
            self.control.setblocking(True)  # replies are few and small; the server always reads them
            try:
                self.control.sendall(message)
            except OSError:
                pass  # the server has gone: the next read ends the loop
            finally:
                self.control.setblocking(False)


def main(argv: list[str]) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket a stream: as many as the system lets us hold
    for stop in (signal.SIGINT, signal.SIGTERM):  # a ^C or a service stop reaches the group: the server ends us
        signal.signal(stop, signal.SIG_IGN)
    control = socket.socket(fileno=int(argv[0]))
    control.setblocking(False)
    Writer(control, float(argv[1])).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
