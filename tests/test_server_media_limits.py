"""Media that could take the server down (issue 19, item 8), sent to a real `lanes serve --vision` process:
each is refused with its frozen words or decoded within a bound, a small request beside them is answered
within a second, and the server's peak memory stays under a stated bound.

Rules: a tiny random Qwen2-VL folder built in the test; the server on 127.0.0.1 port 0 in a process of its
own (CPU, fp32), its peak resident memory reset through /proc/<pid>/clear_refs and read from VmHWM; the
requests' media are made here; every wait is under `trio.fail_after`; the one wait for a state (the heavy
request decoding) polls /v1/info, never sleeps.
"""

import base64
import io
import signal
import struct
import zlib
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import trio
from PIL import Image

import tiny_vl
from lanes.http.errors import MEDIA_WORDS
from mp4_boxes import find, make_mp4, patched, random_clip
from rank_helpers import start

CHAT = "/v1/chat/completions"
MiB = 1 << 20


def data_url(data: bytes, kind: str) -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def chat(*parts: tuple[str, str]) -> dict:
    """A chat request with `(url, "image" | "video")` parts and a question."""
    content = [{"type": f"{kind}_url", f"{kind}_url": {"url": url}} for url, kind in parts]
    return {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": "what is it?"}]}],
            "max_tokens": 2, "temperature": 0}


def palette_bomb() -> bytes:
    """The issue's 8 kB PNG: 8192 x 8192, a 1-bit palette with a transparent colour (64 Mpx once decoded)."""
    bomb = Image.new("P", (8192, 8192), 0)
    bomb.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    out = io.BytesIO()
    bomb.save(out, "PNG", transparency=0, bits=1, optimize=True)
    return out.getvalue()


def lying_png(side: int) -> bytes:
    """A PNG whose header says `side` x `side` and whose pixel data is junk: only decoding would find out."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"junk") + chunk(b"IEND", b"")


def small_png(seed: int, size: tuple[int, int] = (40, 60)) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def lying_mp4s() -> tuple[bytes, bytes]:
    """A fragmented mp4 whose trun declares 0x5000000 samples (3 GB in FFmpeg's index when read as it is),
    and one whose video track's sample entry names no codec (stream.width raised AttributeError)."""
    data = make_mp4(random_clip(4, 16, 16), options={"movflags": "frag_keyframe+empty_moov"})
    bomb = patched(data, find(data, "moof/traf/trun")[0] + 12, 0x5000000)
    codecless = patched(data, find(data, "moov/trak/mdia/minf/stbl/stsd")[0] + 20, int.from_bytes(b"zzzz", "big"))
    return bomb, codecless


class Memory:
    """The server process's resident memory: its peak since the last reset, in bytes."""

    def __init__(self, pid: int) -> None:
        self.proc = Path(f"/proc/{pid}")
        self.base = 0

    def field(self, key: str) -> int:
        line = next(line for line in (self.proc / "status").read_text().splitlines() if line.startswith(key))
        return int(line.split()[1]) * 1024

    def reset(self) -> None:
        (self.proc / "clear_refs").write_text("5")  # VmHWM back to the current resident size
        self.base = self.field("VmRSS")

    def peak(self) -> int:
        return self.field("VmHWM") - self.base


def refusal(reply: httpx.Response) -> tuple[int, str, str]:
    error = reply.json()["error"]
    return reply.status_code, error["code"], error["message"]


async def test_media_bombs_are_refused_or_bounded_and_a_small_request_beside_them_is_prompt(tmp_path):
    folder = tmp_path / "qwen2-vl"
    tiny_vl.build("qwen2_vl", folder)
    bomb, codecless = lying_mp4s()
    async with trio.open_nursery() as nursery:
        served = await start(nursery, folder, "--vision", "--max-model-len", "1024")
        with trio.fail_after(180):
            url = await served.until_serving()
            memory = Memory(served.process.pid)
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                warm = await http.post(CHAT, json=chat((data_url(small_png(0), "image/png"), "image")))
                assert warm.status_code == 200, warm.text

                memory.reset()
                four_bombs = await http.post(CHAT, json=chat(*[(data_url(bomb, "video/mp4"), "video")] * 4))
                assert refusal(four_bombs) == (400, "video_malformed", MEDIA_WORDS["video_malformed"])
                no_codec = await http.post(CHAT, json=chat((data_url(codecless, "video/mp4"), "video")))
                assert refusal(no_codec) == (400, "video_codec", MEDIA_WORDS["video_codec"])
                many = await http.post(CHAT, json=chat(*[(data_url(small_png(1, (1, 1)), "image/png"), "image")] * 1400))
                assert refusal(many) == (400, "too_many_media_parts",
                                         "the request has 1400 images and videos but the server takes at most 16 a request")
                # its measured rows and max_tokens leave no room: refused before decoding, which would find its junk
                liar = await http.post(CHAT, json=chat((data_url(lying_png(6000), "image/png"), "image")) | {"max_tokens": 990})
                assert refusal(liar)[:2] == (400, "context_length_exceeded")
                refusals_peak = memory.peak()

                memory.reset()
                heavy_body = chat(*[(data_url(palette_bomb(), "image/png"), "image")] * 8)
                heavy: list[httpx.Response] = []
                answered = trio.Event()  # set by send_heavy once the heavy request has its answer

                async def send_heavy() -> None:
                    heavy.append(await http.post(CHAT, json=heavy_body))
                    answered.set()

                nursery.start_soon(send_heavy)
                while (await http.get("/v1/info")).json()["media"]["decoding"] == 0:
                    pass  # each poll is a request: the loop waits on the server's state, not on time
                began = trio.current_time()
                small = await http.post(CHAT, json=chat((data_url(small_png(2), "image/png"), "image")))
                waited = trio.current_time() - began
                assert small.status_code == 200, small.text
                assert not heavy  # it was still decoding when the small one was answered
                await answered.wait()
                heavy_peak = memory.peak()
                assert heavy[0].status_code == 200, heavy[0].text
                assert (await http.get("/health")).status_code == 200
            served.signal(signal.SIGTERM)
            assert await served.exit_code() == 0
    assert waited < 1.0, waited
    # the refusals cost nothing: the four trun bombs alone made FFmpeg allocate ~12 GB before
    assert refusals_peak < 64 * MiB, refusals_peak
    # eight 64 Mpx parts decoded one at a time: one part's bound (~0.5 GiB), where all eight at once took 8.5 GB
    assert heavy_peak < 768 * MiB, heavy_peak
    assert "Traceback" not in served.text


def test_the_media_flags_reach_the_server_and_bad_values_are_refused_by_name():
    import argparse

    import pytest

    from lanes.flags import add_serve_flags
    from lanes.serve import NotAvailable, refuse_unbuilt

    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    defaults = parser.parse_args([])
    assert (defaults.max_media_parts, defaults.media_decode_bytes) == (16, 4 << 30)
    refuse_unbuilt(parser.parse_args(["--vision", "--max-media-parts", "1", "--media-decode-bytes", str(256 * MiB)]))
    for flags, message in [(["--max-media-parts", "0"], "--max-media-parts must be at least 1"),
                           (["--media-decode-bytes", str(256 * MiB - 1)], "--media-decode-bytes must be at least 268435456")]:
        with pytest.raises(NotAvailable) as refused:
            refuse_unbuilt(parser.parse_args(flags))
        assert str(refused.value).startswith(message)


def test_info_reports_the_media_bounds_and_the_gate(tmp_path):
    from golden_server import fake_service

    from lanes.http.decode_gate import DecodeGate

    service, _ = fake_service(tmp_path, vision_urls=False, vision_options={"max_parts": 3, "gate": DecodeGate(512 * MiB, 2)})
    assert service.info()["media"] == {"max_parts": 3, "decode_budget_bytes": 512 * MiB, "decode_slots": 2,
                                       "decode_held_bytes": 0, "decoding": 0, "waiting": 0}
    (tmp_path / "plain").mkdir()
    plain, _ = fake_service(tmp_path / "plain")
    assert plain.info()["media"] is None


async def test_a_client_gone_mid_decode_gives_the_gate_back_once_its_thread_is_done(tmp_path):
    from golden_server import fake_service
    from server_helpers import serving, until

    service, _ = fake_service(tmp_path, vision_urls=False, max_model_len=4096, blocks=512)  # room for its 1,280 rows
    gate = service.vision_inputs.gate
    body = chat((data_url(palette_bomb(), "image/png"), "image"))
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(partial(http.post, CHAT, json=body))
                    await until(lambda: gate.statistics().running == 1 and gate.statistics().held_bytes > 256 * MiB)
                    nursery.cancel_scope.cancel()  # the client goes away while its part decodes
                # the part's thread runs on; its reservation stays until the thread returns, then goes
                assert gate.statistics().running == 1
                await until(lambda: gate.statistics().running == 0)
                assert gate.statistics().held_bytes == 0
                assert (await http.get("/health")).status_code == 200
