"""The runtime: one nursery holding the lane core and the HTTP server; SIGINT and SIGTERM shut it down.

Shutdown order: the lane core stops admitting and fails what waits, live streams get `grace` seconds to
finish, then the HTTP server stops (idle connections close, answers under way get a few seconds) and the
nursery closes. A clean shutdown checks the lane core's books (every
lane free, every block back in the pool) and returns normally (exit 0); books that do not balance are a bug,
logged and raised (exit non-zero).
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

import trio

from .core.commands import WarmCancelled
from .core.blocks import IntegrityError
from .core.lane_core import LaneCore
from .core.stream import BackendFailed, EngineError
from .gpu.ranks import PeerLost
from .http.app import LanesApp
from .http.server import HttpServer
from .http.service import Service
from .http.writers import StreamWriters

log = logging.getLogger("lanes")


@dataclass(frozen=True)
class Listening:
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class Runtime:
    """Starts the lane core and the HTTP server in one nursery; `request_stop()` begins the graceful end."""

    def __init__(self, service: Service, *, host: str = "127.0.0.1", port: int = 8000, grace: float = 30.0) -> None:
        self.service = service
        self.host, self.port, self.grace = host, port, grace
        self._stop = trio.Event()  # set by request_stop (a signal, or a test)
        self.listening: Listening | None = None
        self.failure: Exception | None = None  # what ended the server, if it did not stop cleanly
        self.writers: StreamWriters | None = None  # the stream writers, once started (--stream-writers)

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        core: LaneCore = self.service.core
        count = self.service.stream_writers
        writers = StreamWriters(count, self.service.send_timeout) if count else None
        server = HttpServer(LanesApp(self.service), self.service.limits, writers)
        followers = self.service.followers
        async with trio.open_nursery() as nursery:
            if followers is not None:
                await nursery.start(self._guard, followers.run)
            await nursery.start(self._guard, core.run)
            if writers is not None:
                self.writers = await nursery.start(writers.run)
            bound = await nursery.start(self._serve, server, writers)
            host, port = bound[0]
            self.listening = Listening(host, port)
            log.info("serving %s on %s", self.service.model_name, self.listening.url)
            if self.service.tool_system is not None and core.statistics().cache is not None:
                nursery.start_soon(self._warm_tool_system)
            task_status.started(self.listening)
            await self._stop.wait()
            live = core.statistics().lanes_busy
            if self.failure is None:
                log.info("shutting down: %s", f"{self.grace:g} s for {live} live streams to finish" if live
                         else "no live streams")
            await core.shutdown(self.grace if self.failure is None else 0.0)  # returns at once if it failed
            server.begin_close()  # the failed requests write their errors first
            if followers is not None:
                if self.failure is None:
                    await followers.stop()  # every rank exits once the lane core has stopped
                else:
                    followers.abandon()
        if self.failure is not None:
            raise self.failure
        check_books(core)
        log.info("stopped")

    async def _serve(self, server: HttpServer, writers: StreamWriters | None, *,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The HTTP server, then its stream writers (every answer they carried has ended with the server)."""
        try:
            await server.run(self.host, self.port, task_status=task_status)
        finally:
            if writers is not None:
                writers.close()

    async def _guard(self, actor, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run an actor; if it fails (the device, or a rank), every waiter has its error and the server stops."""
        try:
            await actor(task_status=task_status)
        except (BackendFailed, PeerLost) as failure:
            log.error("%s", failure)
            self.failure = self.failure or failure
            self._stop.set()


    async def _warm_tool_system(self) -> None:
        """Prefill the tool system prompt into the prompt cache when the engine is quiet; a request that comes
        first makes it yield, and it tries again at the next quiet moment."""
        service = self.service
        tokens = service.tool_system.warm_tokens(service.tokenizer)
        while True:
            try:
                result = await service.core.warm(tokens)
            except WarmCancelled:
                continue
            except EngineError:
                return  # shutting down
            log.info("tool system prompt warmed: %d tokens cached", len(result.tokens) if result.kept else 0)
            return


def check_books(core: LaneCore) -> None:
    """After a clean stop: raises (and logs) unless the lane core's books balance and every block is free."""
    try:
        core.check_stopped()
    except IntegrityError as error:
        log.error("the lane core's books do not balance at the stop: %s", error)
        raise


async def watch_signals(runtime: Runtime) -> None:
    """The first SIGINT or SIGTERM starts a graceful shutdown; a second one ends the process at once."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for number in signals:
            if runtime._stop.is_set():
                log.warning("second %s: exiting now", signal.Signals(number).name)
                raise SystemExit(130)
            log.info("%s received", signal.Signals(number).name)
            runtime.request_stop()
