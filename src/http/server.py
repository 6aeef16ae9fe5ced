"""An HTTP/1.1 server on trio and h11: one task a connection, kept alive between requests.

What a connection promises (docs/DECISIONS.md, "Our own HTTP/1.1 server"):
- a request's head and body are read to their end before the application answers, so no answer ever
  leaves a body unread on a connection that is kept alive; only a body declared too large is answered
  early (413), and that connection closes;
- a connection that closes sends its end of stream at once (`Connection: close`, HTTP/1.0, a refusal),
  and reads what the client still sends for a moment so that the kernel does not reset its answer;
- while a request is answered, nothing times the client out but the request's own deadline; waiting
  for a next request is bounded by `idle_timeout`, a head and a body by `body_timeout`;
- a client that leaves is seen at once (its connection is read while it is answered) and cancels its
  handler; a write that makes no progress for `send_timeout` seconds ends the response;
- at shutdown the listeners close, idle connections close, and answers under way get `graceful_timeout`.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from contextlib import aclosing
from dataclasses import replace
from functools import partial

import h11
import trio

from .protocol import App, Exchange, HttpRequest, HttpResponse, ServerLimits
from .writers import Relayed, StreamWriters

MAX_RECV = 64 << 10
LINGER = 1.0  # seconds a connection closing on unread input reads on, so its answer is not reset
WRITE_GRACE = 1.0  # past its deadline a response may still write its own deadline error for this long

log = logging.getLogger("lanes.http")


class Gone(Exception):
    """The client closed or reset its connection, or stopped reading (a write made no progress)."""


class Abort(Exception):
    """The answer cannot be finished on this connection (a failure after its head was written)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class HttpServer:
    """Serves `app` on one or more listeners; `begin_close()` starts the graceful end of `run`."""

    def __init__(self, app: App, limits: ServerLimits, writers: StreamWriters | None = None) -> None:
        self.app, self.limits, self.writers = app, limits, writers
        self.closing = False
        self._connections: set[Connection] = set()
        self._close_requested = trio.Event()  # set by begin_close
        self._drained = trio.Event()  # set when the last connection ends after begin_close

    def begin_close(self) -> None:
        self.closing = True
        self._close_requested.set()
        for connection in list(self._connections):
            connection.stop_waiting()
        if not self._connections:
            self._drained.set()

    async def run(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on host:port (0: any free port); `task_status.started` gets the bound (host, port)s."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = [listener.socket.getsockname()[:2] for listener in listeners]
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as accepting:
                accepting.start_soon(partial(trio.serve_listeners, self._serve, listeners,
                                             handler_nursery=connections))
                task_status.started(bound)
                await self._close_requested.wait()
                accepting.cancel_scope.cancel()  # the listeners close with it
            with trio.move_on_after(self.limits.graceful_timeout):
                await self._drained.wait()
            connections.cancel_scope.cancel()

    async def _serve(self, stream: trio.SocketStream) -> None:
        connection = Connection(self, stream)
        self._connections.add(connection)
        try:
            await connection.run()
        finally:
            self._connections.discard(connection)
            if self.closing and not self._connections:
                self._drained.set()


class Connection:
    """One client connection: requests read, handed to the application one at a time, answered in order."""

    def __init__(self, server: HttpServer, stream: trio.SocketStream) -> None:
        self.server, self.stream, self.limits = server, stream, server.limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_headers + 8192)
        self._idle: trio.CancelScope | None = None  # the wait for a next request, cancelled at shutdown
        self._gone = False  # the client closed, reset, or stopped reading
        self._partial = False  # set by `_send` while a write is half done
        self._fd = stream.socket.fileno()
        if self.limits.send_buffer is not None:  # bounds what a client that stops reading leaves in the kernel
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.send_buffer)

    def stop_waiting(self) -> None:
        if self._idle is not None:
            self._idle.cancel()

    async def run(self) -> None:
        unread = False
        try:
            while not self.server.closing:
                read = await self._next_request()
                if read is None:
                    return
                if isinstance(read, HttpResponse):  # refused before the application saw it
                    unread = True
                    return
                if not await self._answer(*read):
                    return
                if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
                    return  # Connection: close, or HTTP/1.0
                self.h11.start_next_cycle()
        except Gone:
            self._gone = True
        finally:
            await self._close(linger=unread and not self._gone)

    # ---- reading ----

    async def _next_request(self) -> tuple[HttpRequest, Exchange] | HttpResponse | None:
        """The next request read whole, with its exchange; None when the client is done (or idle too
        long, or the server closes); the refusal, once written, when the request could not be taken."""
        event, malformed = None, None
        with trio.CancelScope() as self._idle:
            with trio.move_on_after(self.limits.idle_timeout):
                try:
                    event = await self._event()
                except h11.RemoteProtocolError as error:
                    malformed = error.error_status_hint
        self._idle = None
        if malformed is not None:
            return await self._refuse(malformed, None)
        if not isinstance(event, h11.Request):
            return None  # the client closed, or no request came in time
        headers: dict[str, str] = {}
        for name, value in event.headers:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        path, _, query = event.target.decode("latin-1").partition("?")
        request = HttpRequest(event.method.decode("ascii").upper(), path, query, headers,
                              http_version=event.http_version.decode("ascii"))
        exchange = self.server.app.open(request)
        if sum(len(k) + len(v) + 4 for k, v in headers.items()) > self.limits.max_headers:
            return await self._refuse(431, exchange)
        declared = headers.get("content-length")
        if declared is not None and int(declared) > self.limits.max_body:
            return await self._refuse(413, exchange)  # h11 has checked that it is a number
        if self.h11.they_are_waiting_for_100_continue:
            await self._send(self.h11.send(h11.InformationalResponse(status_code=100, headers=[])))
        body, size, refusal = [], 0, 408
        with trio.move_on_after(self.limits.body_timeout):
            try:
                while True:
                    event = await self._event()
                    if isinstance(event, h11.EndOfMessage):
                        return replace(request, body=b"".join(body)), exchange
                    if isinstance(event, h11.ConnectionClosed):
                        exchange.finish(499)
                        raise Gone
                    size += len(event.data)
                    if size > self.limits.max_body:
                        refusal = 413
                        break
                    body.append(event.data)
            except h11.RemoteProtocolError as error:
                refusal = error.error_status_hint
        return await self._refuse(refusal, exchange)

    async def _event(self):
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self._receive())

    async def _receive(self) -> bytes:
        try:
            return await self.stream.receive_some(MAX_RECV)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    # ---- answering ----

    async def _answer(self, request: HttpRequest, exchange: Exchange) -> bool:
        """Hand the request to the application and write its answer; whether the connection may go on."""
        status = 499  # unless the answer is written to its end
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch, nursery.cancel_scope)
                try:
                    response = await self._respond(request, exchange)
                    status = await self._write(request, response, exchange)
                except Gone:
                    self._gone = True
                except Abort as abort:
                    status = abort.status
                    self._gone = True  # a half-written answer: nothing more can follow it
                nursery.cancel_scope.cancel()
        finally:
            exchange.finish(status)
        return not self._gone

    async def _respond(self, request: HttpRequest, exchange: Exchange) -> HttpResponse:
        app = self.server.app
        try:
            return await app.handle(request, exchange)
        except MemoryError:
            log.exception("out of memory on %s %s", request.method, request.path)
            return app.refusal(503, exchange)
        except Exception:
            log.exception("unexpected error on %s %s", request.method, request.path)
            return app.refusal(500, exchange)

    async def _watch(self, answering: trio.CancelScope) -> None:
        """Read the connection while its request is answered: a client that leaves cancels the answer.
        What a pipelining client sends meanwhile waits in h11, up to a bound past which reading stops."""
        while len(self.h11.trailing_data[0]) <= self.limits.max_body + self.limits.max_headers:
            data = await self._receive()
            if not data:
                self._gone = True
                answering.cancel()
                return
            self.h11.receive_data(data)
        await trio.sleep_forever()

    async def _write(self, request: HttpRequest, response: HttpResponse, exchange: Exchange) -> int:
        """Write the response; its status as the log reports it (a stream's own error event counts)."""
        headers = [("content-type", response.content_type), ("x-request-id", exchange.id), *response.headers]
        if self.server.closing:
            headers.append(("connection", "close"))
        if not response.streamed:
            headers.append(("content-length", str(len(response.body))))
        # A stream to an HTTP/1.1 client is chunked by us (RFC 9112's framing, h11 writes the last chunk):
        # h11's own framing of a chunk costs as much as the rest of a streamed token's write.
        framed = response.streamed and self.h11.their_http_version == b"1.1"
        if framed:
            headers.append(("transfer-encoding", "chunked"))
        try:
            head = self.h11.send(h11.Response(status_code=response.status, headers=headers))
        except h11.LocalProtocolError:
            log.exception("an unsendable response to %s %s", request.method, request.path)
            raise Abort(500) from None
        bodiless = request.method == "HEAD"
        late = exchange.deadline + WRITE_GRACE  # no write of this response goes on past it
        if not response.streamed:
            data = b"" if bodiless else self.h11.send(h11.Data(data=response.body))
            await self._send(head + data + self.h11.send(h11.EndOfMessage()), late)
            return response.status
        relayed: Relayed | None = None
        send = self._send  # through the connection's stream writer once it has one
        try:
            answer = response.deadline_answer
            # One cancel scope for the whole stream (not one a chunk): the body's waits end at the deadline.
            with trio.move_on_at(exchange.deadline if answer is not None else late) as waiting:
                async with aclosing(response.body) as chunks:  # closed even if the head cannot be written
                    await self._send(head, late)
                    writers = self.server.writers
                    relayed = None if bodiless or writers is None else writers.open(self._fd)
                    if relayed is not None:
                        send = partial(self._relay, relayed)
                    try:
                        async for chunk in chunks:
                            if chunk and not bodiless:
                                data = self._framed(chunk, framed)
                                if relayed is not None and not (relayed.behind or relayed.gone):
                                    relayed.write(data)  # `_relay`'s usual case, without a coroutine a token
                                else:
                                    await send(data, late)
                    except Exception as error:
                        if isinstance(error, Gone):
                            raise
                        log.exception("a streamed answer to %s %s failed", request.method, request.path)
                        raise Abort(500) from None
            status = exchange.status or response.status
            last = b""
            if waiting.cancelled_caught:
                if answer is None or self._partial:
                    raise Gone  # a chunk cut half-way: nothing more can be written on this connection
                status = exchange.status = answer[0]
                if not bodiless:
                    last = self._framed(answer[1], framed)
            await send(last + self.h11.send(h11.EndOfMessage()), late)
            if relayed is not None:
                await self._flushed(relayed, late)
            return status
        finally:
            if relayed is not None:
                relayed.drop()

    async def _refuse(self, status: int, exchange: Exchange | None) -> HttpResponse:
        """Answer a request the server will not read on (the connection closes after it)."""
        if exchange is None:
            exchange = self.server.app.open(HttpRequest("", "", "", {}))
        response = self.server.app.refusal(status, exchange)
        if not any(name.lower() == "connection" for name, _ in response.headers):
            response.headers.append(("connection", "close"))
        try:
            data = self.h11.send(h11.Response(status_code=status, headers=[
                ("content-type", response.content_type), ("x-request-id", exchange.id),
                ("content-length", str(len(response.body))), *response.headers]))
            await self._send(data + self.h11.send(h11.Data(data=response.body)) + self.h11.send(h11.EndOfMessage()))
            exchange.finish(status)
        except (h11.LocalProtocolError, Gone):
            exchange.finish(499)  # the connection cannot carry an answer any more
        return response

    async def _send(self, data: bytes, until: float = math.inf) -> None:
        """Write `data`; raises Gone when the client has left, when the socket takes nothing for `send_timeout`
        seconds, or at `until`. What the socket takes at once is written without a checkpoint or a cancel
        scope (a streamed token's usual case); only a full socket is waited on, bounded."""
        view, at = memoryview(data), 0
        while True:
            try:
                at += os.write(self._fd, view[at:])
            except BlockingIOError:
                pass
            except OSError:  # reset, broken pipe, or closed under us
                raise Gone from None
            if at == len(view):
                self._partial = False
                return
            self._partial = True
            with trio.move_on_at(min(trio.current_time() + self.limits.send_timeout, until)):
                await trio.lowlevel.wait_writable(self.stream.socket)
                continue
            raise Gone  # the client stopped reading

    def _framed(self, chunk: bytes, framed: bool) -> bytes:
        """A streamed chunk as the connection sends it: our chunked framing, or h11's (HTTP/1.0: unframed)."""
        return b"%x\r\n%b\r\n" % (len(chunk), chunk) if framed else self.h11.send(h11.Data(data=chunk))

    async def _relay(self, relayed: Relayed, data: bytes, until: float = math.inf) -> None:
        """`_send` through a stream writer: raises Gone when the client has left, when its socket has taken
        nothing for `send_timeout` seconds (the writer's count), or at `until` while the writer is behind."""
        if relayed.gone:
            raise Gone
        relayed.write(data)
        if relayed.behind:
            with trio.move_on_at(until):
                await relayed.room()
            if relayed.behind or relayed.gone:
                raise Gone

    async def _flushed(self, relayed: Relayed, until: float) -> None:
        """Until the writer has written all of the answer: the connection's next bytes follow it."""
        with trio.move_on_at(until):
            await relayed.finish()
        if not relayed.flushed:
            raise Gone

    async def _close(self, linger: bool) -> None:
        """End the connection: our end of stream first, then (after a refusal) what the client still
        sends is read for a moment, so that its answer is not lost to a reset."""
        with trio.CancelScope(shield=True):
            if not self._gone:
                with trio.move_on_after(LINGER if linger else 0.05):
                    try:
                        await self.stream.send_eof()
                        while linger and await self.stream.receive_some(MAX_RECV):
                            pass
                    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, OSError):
                        pass
            await self.stream.aclose()
