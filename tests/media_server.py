"""The media fetcher's test fixtures: payloads, the local HTTPS server (h11 over trio's TLS, a trustme
certificate for "media.example") and fetchers that must refuse before resolving or connecting."""

import base64
import ssl
from collections import defaultdict
from dataclasses import replace
from urllib.parse import parse_qs, urlsplit

import h11
import pytest
import trio

from lanes.http.media_fetch import CODES, FetchLimits, MediaFetcher, MediaRefused

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
JPEG = b"\xff\xd8\xff\xe0" + bytes(range(255, -1, -1)) * 3
MP4 = b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 500
PUBLIC = "93.184.216.34"  # passes the production check; the test's connect routes it to the local server
UNCERTIFIED = "93.184.216.35"  # public too, for a name the server's certificate does not cover
HOSTS = {
    "media.example": [PUBLIC],
    "other.example": [UNCERTIFIED],
    "internal.example": ["10.1.2.3"],
}
LIMIT = 5  # seconds any one test may take
ANSWERS = {  # path: status, headers, body of the server's plain answers
    "/cat.png": (200, [("Content-Type", "image/png")], PNG),
    "/cat.jpg": (200, [("Content-Type", "image/jpeg")], JPEG),
    "/clip.mp4": (200, [("Content-Type", "video/mp4")], MP4),
    "/page.html": (200, [("Content-Type", "text/html")], b"<html></html>"),
    "/untyped": (200, [], PNG),
    "/gzipped.png": (200, [("Content-Type", "image/png"), ("Content-Encoding", "gzip")], PNG),
    "/missing": (404, [("Content-Type", "text/plain")], b""),
    "/hop/0": (200, [("Content-Type", "image/png")], PNG),
}
SYSTEM_TRUST = ssl.create_default_context()  # the production default, built once: each costs tens of ms


def data_url(media_type: str, payload: bytes) -> str:
    return f"data:{media_type};base64," + base64.b64encode(payload).decode()


async def next_event(stream, conn: h11.Connection):
    while (event := conn.next_event()) is h11.NEED_DATA:
        conn.receive_data(await stream.receive_some(65536))
    return event


class MediaServer:
    """The local HTTPS server's answers by path, and what it saw: requests, resolutions, connections."""

    def __init__(self):
        self.port = 0
        self.client_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies, and trusts only the test's CA
        self.requests: list[h11.Request] = []
        self.resolved: list[str] = []
        self.connects: list[tuple[str, int]] = []
        self.started: defaultdict[str, trio.Event] = defaultdict(trio.Event)  # set by handle on a request
        self.gone: defaultdict[str, trio.Event] = defaultdict(trio.Event)  # set by handle when the client left

    async def resolve(self, host: str, port: int) -> list[str]:
        self.resolved.append(host)
        if host not in HOSTS:
            raise trio.socket.gaierror(trio.socket.EAI_NONAME, "unknown host")
        return HOSTS[host]

    async def connect(self, ip: str, port: int):
        assert ip in (PUBLIC, UNCERTIFIED), f"asked to connect to {ip}, an address the check should refuse"
        self.connects.append((ip, port))
        return await trio.open_tcp_stream("127.0.0.1", self.port)

    def fetcher(self, **limits) -> MediaFetcher:
        return MediaFetcher(allow_urls=True, limits=FetchLimits(**limits), resolve=self.resolve,
                            connect=self.connect, ssl_context=self.client_context)

    def headers(self, i: int = -1) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.requests[i].headers}

    async def handle(self, stream) -> None:
        conn = h11.Connection(h11.SERVER)
        target = ""
        try:
            request = await next_event(stream, conn)
            if not isinstance(request, h11.Request):
                return
            target = request.target.decode()
            self.requests.append(request)
            self.started[target].set()
            await self.answer(target, stream, conn)
        except trio.BrokenResourceError:
            self.gone[target].set()  # the client closed while we were still sending

    async def answer(self, target: str, stream, conn: h11.Connection) -> None:
        async def respond(status: int, headers: list, body: bytes | None = b"") -> None:
            if body is not None:
                headers = [*headers, ("Content-Length", str(len(body)))]
            await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
            if body is not None:
                await stream.send_all(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))

        async def wait_gone() -> None:
            while await stream.receive_some(65536):
                continue
            self.gone[target].set()

        path = urlsplit(target).path
        if path in ANSWERS:
            await respond(*ANSWERS[path])
        elif path == "/chunked.png":  # no Content-Length: h11 sends it chunked
            await respond(200, [("Content-Type", "image/png; charset=binary")], None)
            await stream.send_all(conn.send(h11.Data(data=PNG[:100])) + conn.send(h11.Data(data=PNG[100:])))
            await stream.send_all(conn.send(h11.EndOfMessage()))
        elif path.startswith("/hop/"):
            await respond(302, [("Location", f"/hop/{int(path.removeprefix('/hop/')) - 1}")])
        elif path == "/redirect":
            await respond(307, [("Location", parse_qs(urlsplit(target).query)["to"][0])])
        elif path == "/huge-declared":
            await respond(200, [("Content-Type", "image/png"), ("Content-Length", str(10**9))], None)
            await wait_gone()
        elif path == "/huge-streamed":
            await respond(200, [("Content-Type", "image/png")], None)
            while True:  # ends when the client stops reading and closes: BrokenResourceError
                await stream.send_all(conn.send(h11.Data(data=b"x" * 1024)))
        elif path == "/trickle":
            await respond(200, [("Content-Type", "image/png"), ("Content-Length", "1000")], None)
            while True:  # the behaviour under test: a byte every 50 ms, never finishing in time
                await stream.send_all(conn.send(h11.Data(data=b"x")))
                await trio.sleep(0.05)
        elif path == "/hang":
            await respond(200, [("Content-Type", "image/png"), ("Content-Length", "1000")], None)
            await stream.send_all(conn.send(h11.Data(data=b"x" * 10)))
            await wait_gone()
        elif path == "/missing-after-hang":
            await self.started["/hang"].wait()
            await respond(404, [])
        else:
            raise AssertionError(f"no route for {target}")


async def never_resolve(host: str, port: int):
    raise AssertionError(f"resolved {host}: the URL should have been refused first")


async def never_connect(ip: str, port: int):
    raise AssertionError(f"connected to {ip}: the check should have refused it")


def offline(allow_urls: bool = False, **limits) -> MediaFetcher:
    """A fetcher that must refuse before it resolves or connects anything."""
    return MediaFetcher(allow_urls=allow_urls, limits=FetchLimits(**limits), resolve=never_resolve,
                        connect=never_connect, ssl_context=SYSTEM_TRUST)


def guarded(addresses: list[str]) -> MediaFetcher:
    """A fetcher whose resolver gives `addresses` for any name, and which must never connect."""

    async def resolve(host: str, port: int) -> list[str]:
        return addresses

    return replace(offline(allow_urls=True), resolve=resolve)


async def refused(fetcher: MediaFetcher, url: str, kind: str = "image") -> MediaRefused:
    with pytest.raises(MediaRefused) as caught:
        await fetcher.fetch(url, kind)
    assert caught.value.code in CODES
    return caught.value
