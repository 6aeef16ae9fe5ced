"""The server under load and at its edges: 32 streaming clients with a third disconnecting, a non-streaming
client leaving, deadlines, the API key, tokenize and detokenize, /v1/info and /metrics, and
`python -m lanes serve` refusing flags by name and ending cleanly on SIGTERM and SIGINT.

Rules: live servers on 127.0.0.1 port 0; tiny models built in the test; clients disconnect by closing
their response or by being cancelled; held passes (never sleeps) make the slow cases; every test under
`trio.fail_after`, a served process's output read under it too; the lane core's integrity and a balanced
block pool are checked when each server stops.
"""

import json
import os
import random
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

import tiny
from golden_server import HELLO, fake_service
from lanes.gpu.device import choose
from lanes.loader import load_model
from server_helpers import counted, serving, torch_service, until

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny.build("llama", folder, max_position_embeddings=512)
    return load_model(folder, choose("cpu", "fp32"), kv_blocks=400, quiet=True)


def body(i: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": f"story {i}: the cat"}], "temperature": 0, "max_tokens": 16,
            "stream": stream, "ignore_eos": True}


async def stream_text(http: httpx.AsyncClient, payload: dict, leave_after: int | None) -> str | None:
    """The streamed text, or None when the client leaves after `leave_after` chunks."""
    parts, seen = [], 0
    async with http.stream("POST", CHAT, json=payload) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            seen += 1
            if leave_after is not None and seen > leave_after:
                return None  # closing the response here is the disconnect
            choice = json.loads(line[6:])["choices"][0]
            parts.append(choice["delta"].get("content") or "")
    return "".join(parts)


@pytest.mark.parametrize("writers", [0, 2])
async def test_32_streaming_clients_a_third_leaving_the_rest_equal_their_solo_runs(tiny_model, writers):
    service = torch_service(tiny_model, lanes=8, max_rows=128, stream_writers=writers)
    chooser = random.Random(5)
    leaving = {i: chooser.randint(1, 12) for i in chooser.sample(range(32), 11)}
    results: dict[int, str | None] = {}
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=64)) as http:

            async def client(i):
                results[i] = await stream_text(http, body(i, True), leaving.get(i))

            async with trio.open_nursery() as nursery:
                for i in range(32):
                    nursery.start_soon(client, i)
            solo = {}
            for i in range(32):
                if i not in leaving:
                    reply = (await http.post(CHAT, json=body(i, False))).json()
                    solo[i] = reply["choices"][0]["message"]["content"]
            info = (await http.get("/v1/info")).json()
    assert all(results[i] is None for i in leaving)
    assert {i: results[i] for i in solo} == solo
    assert info["lanes_busy"] == 0 and info["kv_blocks"]["free"] == info["kv_blocks"]["total"]
    stats = service.core.statistics()
    # A client that leaves after its stream already ended in the engine cancels nothing.
    assert 1 <= stats.streams_cancelled <= 11 and stats.streams_cancelled + stats.streams_finished == 32 + 21


async def test_a_non_streaming_client_that_leaves_cancels_its_stream_and_frees_its_lane_within_one_pass(tmp_path):
    service, backend = fake_service(tmp_path, lanes=1)
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            entered, release = backend.hold()
            async with trio.open_nursery() as client:
                client.start_soon(partial(http.post, CHAT, json={"messages": HELLO, "max_tokens": 40, "ignore_eos": True}))
                await entered.wait()  # its first pass is inside the backend
                client.cancel_scope.cancel()  # the client goes away before any answer
            await until(lambda: counted(service, "chat", 499) == 1)  # the handler saw it and closed the stream
            at_leave = service.core.statistics()
            release.set()
            await until(lambda: service.core.statistics().lanes_busy == 0)
            info = (await http.get("/v1/info")).json()
    stats = service.core.statistics()
    assert (at_leave.lanes_busy, at_leave.passes) == (1, 0)
    assert (stats.passes, stats.streams_cancelled, stats.tokens_out) == (1, 1, 0)  # freed at the held pass's boundary
    assert (info["lanes_busy"], info["admission"]["open_requests"]) == (0, 0)


@pytest.mark.parametrize("writers", [0, 1])
async def test_past_its_deadline_a_request_gets_a_timeout_and_a_stream_an_error_event(tmp_path, writers):
    service, backend = fake_service(tmp_path, request_timeout=0.3, stream_writers=writers)
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            entered, release = backend.hold()
            plain = await http.post(CHAT, json={"messages": HELLO, "max_tokens": 4})  # its pass is held past 0.3 s
            assert entered.is_set()
            assert plain.status_code == 504
            assert plain.json()["error"]["code"] == "deadline_exceeded"
            release.set()
            entered, release = backend.hold()
            async with http.stream("POST", CHAT, json={"messages": HELLO, "max_tokens": 4, "stream": True}) as response:
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            release.set()
    assert json.loads(lines[-2][6:])["error"]["code"] == "deadline_exceeded"
    assert lines[-1] == "data: [DONE]"


async def test_the_api_key_is_required_and_health_is_open(tmp_path):
    service, _ = fake_service(tmp_path, api_key="s3cret")
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/v1/models")).status_code == 401
            ok = await http.post(CHAT, json={"messages": HELLO, "max_tokens": 2},
                                 headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


async def test_tokenize_detokenize_models_info_and_metrics(tiny_model):
    service = torch_service(tiny_model)
    tokenizer = tiny_model.tokenizer
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            tokens = (await http.post("/v1/tokenize", json={"prompt": "the cat in the hat"})).json()
            assert tokens["tokens"] == tokenizer.encode("the cat in the hat") and tokens["count"] == len(tokens["tokens"])
            chat = (await http.post("/v1/tokenize", json={"messages": HELLO})).json()
            assert chat["tokens"] == tokenizer.encode_prompt(tokenizer.render_chat(HELLO))
            paired = await http.post("/v1/tokenize", content='{"prompt": "\\ud83d\\ude00"}')  # an escaped pair is text
            assert paired.json()["tokens"] == tokenizer.encode("\U0001F600")
            text = (await http.post("/v1/detokenize", json={"tokens": tokens["tokens"]})).json()
            assert text == {"prompt": "the cat in the hat"}
            models = (await http.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["tiny"]
            info = (await http.get("/v1/info")).json()
            shown = {key: info[key] for key in ("model", "family", "lanes", "max_rows", "tp", "vision", "decides")}
            assert shown == {"model": "tiny", "family": "llama", "lanes": 4, "max_rows": 64, "tp": 1, "vision": False,
                             "decides": False}
            assert info["admission"] == {"max_queue": 64, "queued": 0, "max_model_len": 256, "request_timeout": 600.0,
                                         "max_body_bytes": 4 << 20, "max_header_bytes": 16 << 10,
                                         "max_open_requests": 1024, "open_requests": 0, "send_timeout": 30.0,
                                         "stream_writers": 0}
            await http.post(CHAT, json={"messages": HELLO, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
            metrics = (await http.get("/metrics")).text
    lines = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert float(lines['lanes_requests_total{endpoint="chat",model_name="tiny",status="200"}']) == 1.0
    assert float(lines['lanes_completion_tokens_total{model_name="tiny"}']) == 5.0
    assert float(lines['lanes_time_to_first_token_seconds_count{model_name="tiny"}']) == 1.0
    assert float(lines['lanes_inter_token_seconds_count{model_name="tiny"}']) == 4.0
    assert float(lines['lanes_lanes{model_name="tiny"}']) == 4.0
    assert float(lines['lanes_queue_length{model_name="tiny"}']) == 0.0


SERVE = [sys.executable, "-m", "lanes", "serve", "--device", "cpu", "--max-model-len", "128"]


@pytest.mark.parametrize("flag", ["--vision", "--vision-urls"])
def test_serve_refuses_a_vision_flag_it_cannot_honour_by_name(tmp_path, flag):
    tiny.build("llama", tmp_path)  # a text family
    refused = subprocess.run([*SERVE, "--model", str(tmp_path), flag], capture_output=True, text=True, timeout=120)
    expected = {"--vision": f"{tmp_path}: the llama family takes no images or videos (vision families: qwen2_vl, qwen2_5_vl)",
                "--vision-urls": "--vision-urls needs --vision"}[flag]
    assert (refused.returncode, refused.stderr.strip().splitlines()[-1]) == (2, f"lanes: error: {expected}")


async def line_with(stream: trio.abc.ReceiveStream, word: str, seen: bytearray) -> str:
    """The first whole line holding `word`, reading `stream` into `seen` (under the caller's fail_after)."""
    while True:
        for line in seen.decode(errors="replace").splitlines(keepends=True):
            if word in line and line.endswith("\n"):
                return line
        chunk = await stream.receive_some()
        assert chunk, f"the server ended before printing {word!r}: {seen.decode(errors='replace')}"
        seen += chunk


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_serve_ends_cleanly_with_exit_0_on_sigterm_and_sigint(tmp_path, stop):
    tiny.build("llama", tmp_path)
    seen = bytearray()
    with trio.fail_after(120):  # a server that stalls before "serving", or never stops, fails here
        server = await trio.lowlevel.open_process([*SERVE, "--model", str(tmp_path), "--port", "0"],
                                                  stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            url = (await line_with(server.stderr, "serving", seen)).rsplit(" on ", 1)[1].strip()
            async with httpx.AsyncClient(timeout=60) as http:
                reply = await http.post(f"{url}{CHAT}", json={"messages": HELLO, "max_tokens": 3})
            assert reply.status_code == 200
            server.send_signal(stop)
            assert await server.wait() == 0
            async for chunk in server.stderr:
                seen += chunk
        finally:
            server.kill()
    log = seen.decode()
    assert f"{stop.name} received" in log and "stopped" in log and "Traceback" not in log
    assert log.count(" on http://") == 1 and "Running on" not in log  # where it serves, said once
    assert "shutting down: no live streams" in log and "garbage collector" not in log  # that line is debug's


async def test_serve_with_stream_writers_streams_and_ends_cleanly_when_the_whole_group_gets_sigterm(tmp_path):
    tiny.build("llama", tmp_path)
    seen = bytearray()
    with trio.fail_after(120):
        server = await trio.lowlevel.open_process([*SERVE, "--model", str(tmp_path), "--port", "0", "--stream-writers", "2"],
                                                  stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            url = (await line_with(server.stderr, "serving", seen)).rsplit(" on ", 1)[1].strip()
            writers = [int(pid) for path in Path(f"/proc/{server.pid}/task").glob("*/children")
                       for pid in path.read_text().split()]
            async with httpx.AsyncClient(timeout=60) as http:
                async with http.stream("POST", f"{url}{CHAT}", json={"messages": HELLO, "max_tokens": 3, "stream": True,
                                                                    "ignore_eos": True, "stream_options": {"include_usage": True}}) as reply:
                    lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
                info = (await http.get(f"{url}/v1/info")).json()
            for pid in (server.pid, *writers):  # as a service manager or a terminal signals the whole group
                os.kill(pid, signal.SIGTERM)
            assert await server.wait() == 0
            async for chunk in server.stderr:
                seen += chunk
        finally:
            server.kill()
    assert len(writers) == 2 and info["admission"]["stream_writers"] == 2
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 3 and lines[-1] == "data: [DONE]"
    for pid in writers:  # ended with the server, and reaped by it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    log = seen.decode()
    assert "stopped" in log and "Traceback" not in log and "stopped answering" not in log


def test_help_answers_without_the_engine_and_its_flags_defaults_are_what_the_readme_says():
    shown = subprocess.run([sys.executable, "-c", "import sys; from lanes.cli import main\n"
                            "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
                            "print('torch' in sys.modules, 'trio' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert shown.stdout.strip().splitlines()[-1] == "False False"  # --help never pays for torch's import
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "| `--tp`, `--rank`, `--master`, `--master-port` | 1, none, none, none |" in readme
    for flag in ("--send-timeout", "--keep-alive-timeout", "--send-buffer", "--stream-writers", "--max-media-parts"):
        assert f"| `{flag}` |" in readme and flag in shown.stdout


async def test_a_client_that_sends_its_body_too_slowly_gets_408_and_the_server_stays_up(tmp_path):
    service, _ = fake_service(tmp_path, body_timeout=0.5)
    async with serving(service) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with trio.fail_after(20):
            stream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 100\r\n\r\n{\"messages\": ")  # and then nothing more
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                reply += chunk
            await stream.aclose()
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert json.loads(body)["error"] == {"message": "the request body did not arrive within 0.5 seconds",
                                             "type": "invalid_request_error", "param": None, "code": "body_timeout"}
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            assert (await http.get("/health")).status_code == 200
            info = (await http.get("/v1/info")).json()
            metrics = (await http.get("/metrics")).text
    assert info["admission"]["open_requests"] == 0  # the slow request's slot was given back
    assert 'lanes_requests_total{endpoint="chat",model_name="tiny",status="408"} 1.0' in metrics  # counted as what it got


async def test_after_a_refusal_that_leaves_the_body_unread_the_clients_next_request_gets_a_fresh_connection(tmp_path):
    """413 is sent before the body is read to its end, so the connection must close: a client that reused it
    would wait for an answer that never comes (the soak found such requests stalled)."""
    service, _ = fake_service(tmp_path)
    async with serving(service) as url:
        with trio.fail_after(30):
            async with httpx.AsyncClient(base_url=url, timeout=10, limits=httpx.Limits(max_connections=1)) as http:
                for _ in range(3):
                    refused = await http.post(CHAT, content=b"x" * (5 << 20), headers={"Content-Type": "application/json"})
                    assert refused.status_code == 413 and refused.headers["connection"] == "close"
                    answered = await http.post(CHAT, json={"messages": HELLO, "max_tokens": 2})
                    assert answered.status_code == 200
