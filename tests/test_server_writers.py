"""Stream writers (`--stream-writers`): processes that write streamed answers to the clients' sockets.

What they must keep: the bytes a client reads (the same as the event loop writes itself), one message a
pass to each writer rather than one write a token, a writer that dies ends only its own streams (their
lanes freed, the server writing on alone), and no writer outlives the server. The behaviours shared with
the one-process server (clients that leave, stop reading, outlive the idle timeout, meet their deadline)
are the same tests run with writers, in test_http_connections.py and test_server_behaviour.py.

Rules: live servers on 127.0.0.1 port 0 on the fake backend; raw sockets read back through h11's client
side; "later" means once every server task is blocked, never a sleep; every wait under `trio.fail_after`;
the lane core's books are checked when each server stops.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from golden_server import HELLO, fake_service
from lanes.http import wire
from lanes.http.writers import _messages
from lanes.runtime import Runtime
from server_helpers import counted, until
from test_http_connections import connect, head

CHAT = "/v1/chat/completions"
CHANGING = re.compile(rb'"(id|created)": ?("[^"]*"|\d+)')  # what differs between two answers to one request
CHOICE = re.compile(rb'"choices": \[\{"index": (\d+)')


def by_choice(answer: bytes) -> dict[bytes, list[bytes]]:
    """An answer's events, each choice's in order (n choices interleave as their passes' timing has it)."""
    events: dict[bytes, list[bytes]] = {}
    for event in CHANGING.sub(b"", answer).split(b"\n\n"):
        index = CHOICE.search(event)
        events.setdefault(index.group(1) if index else b"", []).append(event)
    return events


@asynccontextmanager
async def running(service):
    """The runtime itself (its writers' processes are what these tests look at); books checked after."""
    runtime = Runtime(service, host="127.0.0.1", port=0, grace=5.0)
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(runtime.run)
        try:
            yield runtime, listening.url
        finally:
            runtime.request_stop()
    core = service.core
    core.check_integrity()
    assert core.pool.free == core.pool.total and all(job is None for job in core.lanes)


async def streamed(url: str, path: str, payload: dict) -> bytes:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with http.stream("POST", path, json=payload) as response:
            assert response.status_code == 200
            return b"".join([chunk async for chunk in response.aiter_bytes()])


REQUESTS = [
    (CHAT, {"messages": HELLO, "max_tokens": 12, "ignore_eos": True, "stream": True, "n": 2, "seed": 7, "logprobs": True,
            "top_logprobs": 2, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "the cat", "max_tokens": 9, "stream": True, "echo": True, "temperature": 0}),
    (CHAT, {"messages": HELLO, "max_tokens": 6, "stream": True, "stop": ["t9"], "seed": 3}),
]


async def test_streams_through_writers_are_the_bytes_the_event_loop_writes(tmp_path):
    answers = {}
    for writers in (0, 2):
        (tmp_path / str(writers)).mkdir()
        service, _ = fake_service(tmp_path / str(writers), max_model_len=256, stream_writers=writers)
        with trio.fail_after(60):
            async with running(service) as (_, url):
                answers[writers] = [await streamed(url, path, body) for path, body in REQUESTS]
    assert [by_choice(answer) for answer in answers[2]] == [by_choice(answer) for answer in answers[0]]
    assert all(answer.endswith(b"data: [DONE]\n\n") for answer in answers[2])
    assert len(by_choice(answers[2][0])) == 3  # two choices, and the usage and [DONE] after them


async def test_a_pass_is_one_message_to_a_writer_not_one_a_token_and_writers_end_with_the_server(tmp_path):
    service, backend = fake_service(tmp_path, lanes=8, blocks=256, max_model_len=256, stream_writers=1)
    body = {"messages": HELLO, "max_tokens": 32, "ignore_eos": True, "stream": True}
    with trio.fail_after(60):
        async with running(service) as (runtime, url):
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(streamed, url, CHAT, body)
            links = runtime.writers.links
            stats = service.core.statistics()
    assert stats.tokens_out == 8 * 32
    # 256 tokens in about 33 passes; every stream's socket handed over and ended besides.
    assert sum(link.messages for link in links) <= stats.passes + 2 * 8
    assert all(link.process.returncode is not None for link in links)


async def test_ninety_six_streams_opened_together_are_all_whole_through_two_writers(tmp_path):
    service, backend = fake_service(tmp_path, lanes=32, blocks=1024, max_model_len=128, max_queue=128, stream_writers=2)
    body = {"messages": HELLO, "max_tokens": 8, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    answers = []
    with trio.fail_after(60):
        async with running(service) as (runtime, url):
            entered, release = backend.hold()  # the first pass waits: every request's head is written meanwhile
            async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=128)) as http:

                async def one():
                    async with http.stream("POST", CHAT, json=body) as response:
                        answers.append(b"".join([chunk async for chunk in response.aiter_bytes()]))

                async with trio.open_nursery() as nursery:
                    for _ in range(96):
                        nursery.start_soon(one)
                    await entered.wait()
                    release.set()
            links = runtime.writers.links
    assert len(answers) == 96 and all(a.endswith(b"data: [DONE]\n\n") and b'"completion_tokens": 8' in a for a in answers)
    assert all(link.alive for link in links)


async def test_an_http_1_0_stream_through_a_writer_is_unframed_and_its_connection_ends_after_it(tmp_path):
    service, _ = fake_service(tmp_path, stream_writers=1)
    body = json.dumps({"messages": HELLO, "max_tokens": 5, "ignore_eos": True, "stream": True}).encode()
    with trio.fail_after(30):
        async with running(service) as (_, url):
            stream, _ = await connect(url)
            async with stream:
                await stream.send_all(head("POST", CHAT, body, version="1.0") + body)
                seen = b""
                while data := await stream.receive_some(65536):  # the server's end of stream ends the answer
                    seen += data
    answer_head, _, answer = seen.partition(b"\r\n\r\n")
    assert answer_head.startswith(b"HTTP/1.1 200") and b"chunked" not in answer_head.lower()
    assert answer.startswith(b"data: {") and answer.endswith(b"data: [DONE]\n\n") and answer.count(b'"content"') >= 5


async def test_a_writer_that_dies_ends_its_streams_frees_their_lanes_and_the_server_writes_on_alone(tmp_path, caplog):
    service, backend = fake_service(tmp_path, lanes=2, blocks=2048, max_model_len=4096, stream_writers=1)
    backend.pass_seconds = 0.01  # 2,000 tokens: 20 s, far more than the test takes
    caplog.set_level(logging.ERROR, logger="lanes.http")
    with trio.fail_after(60):
        async with running(service) as (runtime, url):
            stream, reader = await connect(url)
            async with stream:
                body = json.dumps({"messages": HELLO, "max_tokens": 2000, "ignore_eos": True, "stream": True}).encode()
                await stream.send_all(head("POST", CHAT, body) + body)
                seen = b""
                while b"data: {" not in seen:
                    seen += await stream.receive_some(65536)
                os.kill(runtime.writers.pids[0], signal.SIGKILL)
                while data := await stream.receive_some(65536):
                    seen += data
            await until(lambda: service.core.statistics().lanes_busy == 0)
            after = await streamed(url, CHAT, {"messages": HELLO, "max_tokens": 4, "ignore_eos": True, "stream": True})
            status = counted(service, "chat", 499)
    assert b"[DONE]" not in seen and status == 1  # the first stream ended early, as if its client had left
    assert after.endswith(b"data: [DONE]\n\n") and after.count(b'"content"') >= 4
    assert "stopped answering" in caplog.text


def test_a_writer_process_takes_a_message_of_many_sockets_writes_each_in_order_and_says_so():
    import array
    import socket
    import subprocess
    import sys

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    writer = subprocess.Popen([sys.executable, "-m", "lanes.http.writer", str(theirs.fileno()), "5"],
                              pass_fds=(theirs.fileno(),))
    theirs.close()
    clients = [socket.socketpair() for _ in range(wire.MOST_FDS)]
    try:
        queue = [(wire.OPEN, i, os.dup(server.fileno())) for i, (server, _) in enumerate(clients)]
        queue += [(wire.DATA, i, b"%d:" % i + bytes([i]) * 3000) for i in range(wire.MOST_FDS)]
        queue += [(wire.DATA, i, b"!") for i in range(wire.MOST_FDS)] + [(wire.END, i, b"") for i in range(wire.MOST_FDS)]
        messages = list(_messages(queue))
        assert len(messages[0][1]) == wire.MOST_FDS  # every socket in the first message
        for message, fds in messages:
            ours.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])
            for fd in fds:
                os.close(fd)
        ours.settimeout(30)
        replies = []
        while len(replies) < wire.MOST_FDS:
            replies += [r for r in wire.replies(ours.recv(65536)) if r[0] == wire.FLUSHED]
        for server, _ in clients:
            server.close()  # the writer closed its own copy on FLUSHED: the client now sees its end
        for i, (_, client) in enumerate(clients):
            client.settimeout(30)
            got = b"".join(iter(lambda: client.recv(65536), b""))
            assert got == b"%d:" % i + bytes([i]) * 3000 + b"!"
        assert sorted(replies) == [(wire.FLUSHED, i) for i in range(wire.MOST_FDS)]
    finally:
        ours.close()
        assert writer.wait(timeout=30) == 0  # its end closed: it exits
        for pair in clients:
            for end in pair:
                end.close()


@pytest.mark.parametrize("sizes", [[10, 20], [wire.MESSAGE + 5], [wire.MESSAGE - 3, 7, 1], [1] * 9000])
def test_records_pack_into_bounded_messages_in_order_with_their_descriptors(sizes):
    queue = [(wire.OPEN, i, 1000 + i) for i in range(wire.MOST_FDS + 3)]
    queue += [(wire.DATA, 7, bytes([i % 256]) * size) for i, size in enumerate(sizes)] + [(wire.END, 7, b"")]
    messages = list(_messages(queue))
    assert all(len(message) <= wire.MESSAGE for message, _ in messages)
    assert all(len(fds) <= wire.MOST_FDS for _, fds in messages)
    records = [r for message, _ in messages for r in wire.records(message)]
    assert [fd for _, fds in messages for fd in fds] == [1000 + i for i in range(wire.MOST_FDS + 3)]
    assert [(k, c) for k, c, _ in records if k == wire.OPEN] == [(wire.OPEN, i) for i in range(wire.MOST_FDS + 3)]
    assert b"".join(p for k, _, p in records if k == wire.DATA) == b"".join(bytes([i % 256]) * s for i, s in enumerate(sizes))
    assert records[-1][:2] == (wire.END, 7)
