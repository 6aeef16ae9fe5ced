"""The HTTP server's connections as real clients drive them: early answers that keep the connection usable,
connections that close at once, streams longer than the idle timeout, and clients that stop reading.

Rules: live servers on 127.0.0.1 port 0 on the fake backend; raw sockets spoken to in HTTP/1.1 and read back
through h11's client side (a parser no one here wrote); the official `openai` client for its own calls;
"later" means once every server task is blocked (`wait_all_tasks_blocked`), never a sleep; every wait under
`trio.fail_after`; the lane core's books are checked when each server stops.
"""

from __future__ import annotations

import json
import socket

import h11
import pytest
import trio
import trio.testing

from golden_server import HELLO, fake_service
from server_helpers import client, counted, serving, until

CHAT = "/v1/chat/completions"
BODY = json.dumps({"messages": HELLO, "max_tokens": 2, "ignore_eos": True}).encode()


def head(method: str, path: str, body: bytes = b"", *extra: str, version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: test", "Content-Type: application/json", *extra]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Reader:
    """Responses read off one connection with h11's client side, one after another."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream, self.h11 = stream, h11.Connection(h11.CLIENT)

    async def response(self, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        self.h11.send(h11.Request(method=method, target="/", headers=[("Host", "test")]))  # what h11 expects us to have sent
        self.h11.send(h11.EndOfMessage())
        status, headers, body = None, {}, b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                    self.h11.start_next_cycle()
                return status, headers, body

    async def closed(self) -> bool:
        """Whether the server's next bytes are its end of stream."""
        return await self.stream.receive_some(65536) == b""


async def connect(url: str) -> tuple[trio.SocketStream, Reader]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    return stream, Reader(stream)


EARLY = {  # name -> (server options, method, path, extra headers, status)
    "wrong-key": ({"api_key": "s3cret"}, "POST", CHAT, ("Authorization: Bearer wrong",), 401),
    "unknown-endpoint": ({}, "POST", "/v1/embeddings", (), 404),
    "wrong-method": ({}, "PUT", CHAT, (), 405),
    "max-open": ({"max_open": 0}, "POST", CHAT, (), 429),
    "get-with-a-body": ({}, "GET", "/health", (), 200),
}


@pytest.mark.parametrize("name", EARLY)
async def test_an_answer_that_needs_no_body_waits_for_it_and_the_connection_serves_the_next_request(tmp_path, name):
    options, method, path, extra, status = EARLY[name]
    service, _ = fake_service(tmp_path, **options)
    async with serving(service) as url:
        with trio.fail_after(10):
            stream, reader = await connect(url)
            async with stream:
                await stream.send_all(head(method, path, BODY, *extra))
                await trio.testing.wait_all_tasks_blocked()  # the server has the head and waits: the body comes later
                await stream.send_all(BODY)
                first = await reader.response(method)
                await stream.send_all(head("GET", "/health"))
                with trio.fail_after(1):
                    second = await reader.response()
    assert first[0] == status and first[1]["content-type"] == "application/json"
    assert second[0] == 200 and json.loads(second[2]) == {"status": "ok"}


@pytest.mark.parametrize("extra, version", [(("Connection: close",), "1.1"), ((), "1.0")])
async def test_a_connection_that_asks_to_close_gets_its_answer_then_its_end_at_once(tmp_path, extra, version):
    service, _ = fake_service(tmp_path)
    async with serving(service) as url:
        with trio.fail_after(10):
            stream, reader = await connect(url)
            async with stream:
                await stream.send_all(head("POST", CHAT, BODY, *extra, version=version) + BODY)
                status, _, body = await reader.response("POST")
                with trio.fail_after(1):
                    assert await reader.closed()
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"


async def test_a_declared_body_too_large_is_refused_before_it_is_read_and_the_connection_ends(tmp_path):
    service, _ = fake_service(tmp_path)
    async with serving(service) as url:
        with trio.fail_after(10):
            stream, reader = await connect(url)
            async with stream:
                await stream.send_all(head("POST", CHAT, b"x" * (service.max_body + 1)))
                status, headers, body = await reader.response("POST")
                with trio.fail_after(1):
                    assert await reader.closed()
    assert (status, headers["connection"], json.loads(body)["error"]["code"]) == (413, "close", "body_too_large")
    assert counted(service, "chat", 413) == 1


async def test_200_openai_calls_alternating_an_unknown_endpoint_and_a_real_one_are_each_answered_within_2_s(tmp_path):
    import time

    import openai

    service, _ = fake_service(tmp_path)
    async with serving(service) as url:
        api = client(url, timeout=10)

        def calls() -> list[float]:
            took = []
            for i in range(100):
                started = time.perf_counter()
                with pytest.raises(openai.NotFoundError):
                    api.embeddings.create(model="tiny", input=f"probe {i}")
                took.append(time.perf_counter() - started)
                started = time.perf_counter()
                reply = api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, extra_body={"ignore_eos": True})
                took.append(time.perf_counter() - started)
                assert reply.choices[0].finish_reason == "length"
            return took

        with trio.fail_after(120):
            took = await trio.to_thread.run_sync(calls)
    assert len(took) == 200 and max(took) < 2.0, max(took)
    assert counted(service, "unrouted", 404) == 100 and counted(service, "chat", 200) == 100


@pytest.mark.parametrize("writers", [0, 1])
async def test_a_stream_that_outlives_the_idle_timeout_ends_with_done(tmp_path, writers):
    service, backend = fake_service(tmp_path, idle_timeout=0.1, stream_writers=writers)
    backend.pass_seconds = 0.05  # 12 tokens: about 0.6 s, six idle timeouts
    async with serving(service) as url:
        with trio.fail_after(30):
            stream, reader = await connect(url)
            async with stream:
                body = json.dumps({"messages": HELLO, "max_tokens": 12, "ignore_eos": True, "stream": True}).encode()
                await stream.send_all(head("POST", CHAT, body) + body)
                status, _, streamed = await reader.response("POST")
                body = json.dumps({"messages": HELLO, "max_tokens": 12, "ignore_eos": True}).encode()
                await stream.send_all(head("POST", CHAT, body) + body)  # and a whole answer as long, on the same connection
                whole = await reader.response("POST")
    events = [line for line in streamed.decode().split("\n\n") if line]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert whole[0] == 200 and json.loads(whole[2])["usage"]["completion_tokens"] == 12


async def stalled_client(url: str, max_tokens: int) -> trio.SocketStream:
    """A client with a tiny receive buffer that sends a streaming request and never reads."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    body = json.dumps({"messages": HELLO, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
    await stream.send_all(head("POST", CHAT, body) + body)
    return stream


@pytest.mark.parametrize("writers", [0, 1])
async def test_eight_clients_that_stop_reading_lose_their_lanes_after_the_send_timeout_and_a_ninth_is_served(tmp_path, writers):
    service, _ = fake_service(tmp_path, lanes=8, blocks=2048, max_model_len=4096, send_timeout=0.5,
                              send_buffer=4096, cache_bytes=512, stream_writers=writers)
    core = service.core
    async with serving(service) as url:
        with trio.fail_after(60):
            stalled = [await stalled_client(url, 4000) for _ in range(8)]
            await until(lambda: core.statistics().lanes_busy == 8)
            started = trio.current_time()
            async with stalled[0]:  # the stalled clients stay connected, unread, until the ninth is answered
                await until(lambda: counted(service, "chat", 499) == 8)
                freed = trio.current_time() - started
                await until(lambda: core.statistics().lanes_busy == 0)
                stats, cache = core.statistics(), core.cache.statistics()
                with trio.fail_after(5):
                    api = client(url, timeout=5)
                    reply = await trio.to_thread.run_sync(
                        lambda: api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4,
                                                           extra_body={"ignore_eos": True}))
            for stream in stalled[1:]:
                await stream.aclose()
    assert (stats.lanes_busy, cache.pinned, stats.blocks_free + cache.entries) == (0, 0, stats.blocks_total)
    assert stats.tokens_out < 8 * 600  # each stopped when its buffers filled: none ran to its 4,000 tokens
    assert freed < 0.5 + 2.0  # the send timeout and the time the buffers took to fill
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4


@pytest.mark.parametrize("writers", [0, 1])
async def test_a_stalled_stream_ends_at_its_request_deadline_when_that_comes_before_the_send_timeout(tmp_path, writers):
    service, _ = fake_service(tmp_path, lanes=1, blocks=2048, max_model_len=4096, send_timeout=60, send_buffer=4096,
                              request_timeout=0.5, stream_writers=writers)
    async with serving(service) as url:
        with trio.fail_after(30):
            async with await stalled_client(url, 4000):
                started = trio.current_time()
                await until(lambda: counted(service, "chat", 499) == 1)
                took = trio.current_time() - started
                await until(lambda: service.core.statistics().lanes_busy == 0)
    assert took < 0.5 + 1.0 + 1.0  # the deadline, the grace a deadline error is given to be written, a margin
