"""media_fetch: strict data URLs, and public HTTPS URLs fetched with every hop's addresses checked.

Rules: a local HTTPS server on 127.0.0.1 port 0 with a trustme certificate for "media.example", speaking
h11; the fetcher's production checks are never loosened: the test injects a resolver that names public
addresses and a connect function that routes those public addresses (and only those) to the local server.
Every test runs under `trio.fail_after`; events set by the server's handler (never sleeps) say when it has
started answering or seen the client go; time limits are real and a fraction of a second.
"""

import base64
import ipaddress
import ssl
from collections import defaultdict
from dataclasses import replace
from functools import partial
from urllib.parse import parse_qs, urlsplit

import h11
import pytest
import trio
import trustme

from lanes.http.media_fetch import CODES, FetchLimits, MediaFetcher, MediaPart, MediaRefused, is_public

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


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture
async def server(ca, nursery):
    media = MediaServer()
    ca.configure_trust(media.client_context)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("media.example").configure_cert(context)
    serve = partial(trio.serve_ssl_over_tcp, media.handle, 0, context, host="127.0.0.1", https_compatible=True)
    listeners = await nursery.start(serve)
    media.port = listeners[0].transport_listener.socket.getsockname()[1]
    return media


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


# Data URLs

@pytest.mark.parametrize("media_type, kind, payload", [
    ("image/png", "image", PNG), ("image/jpeg", "image", JPEG), ("video/mp4", "video", MP4),
    ("IMAGE/PNG;name=cat.png", "image", PNG),
])
async def test_data_urls_need_no_flag(media_type, kind, payload):
    with trio.fail_after(LIMIT):
        assert await offline().fetch(data_url(media_type, payload), kind) == payload


@pytest.mark.parametrize("url, kind", [
    ("data:image/png,rawbytes", "image"), ("data:image/png;base64", "image"), ("data:;base64,iVBORw==", "image"),
    ("data:text/plain;base64,iVBORw==", "image"), ("data:video/mp4;base64,iVBORw==", "image"),
    ("data:image/png;base64,iVBORw==", "video"), ("data:image/png;base64,@@@@", "image"),
    ("data:image/png;base64,iVBORw", "image"), ("data:image/png;base64,iVBO Rw==", "image"),
    ("data:image/png;base64,iVBORw==\n", "image"), ("data:image/png;base64,ïVBORw==", "image"),
    ("data:image/png;base64,", "image"),
])
async def test_bad_data_urls(url, kind):
    with trio.fail_after(LIMIT):
        assert (await refused(offline(), url, kind)).code == "bad_data_url"


async def test_data_url_limit_is_on_the_decoded_length():
    fetcher = offline(max_bytes=16)
    with trio.fail_after(LIMIT):
        assert await fetcher.fetch(data_url("image/png", PNG[:16]), "image") == PNG[:16]
        assert (await refused(fetcher, data_url("image/png", PNG[:17]))).code == "media_too_large"


async def test_oversize_data_url_refused_before_decoding():
    # Not base64 at all: only a length check made before decoding can answer media_too_large.
    fetcher = offline(max_bytes=1024)
    with trio.fail_after(LIMIT):
        assert (await refused(fetcher, "data:image/png;base64," + "!" * 10**7)).code == "media_too_large"


# URLs and addresses, refused before any connection

@pytest.mark.parametrize("url", [
    "https://media.example/cat.png", "http://media.example/cat.png", "ftp://media.example/cat.png",
    "file:///etc/passwd",
])
async def test_urls_refused_without_the_flag(url):
    with trio.fail_after(LIMIT):
        assert (await refused(offline(), url)).code == "media_urls_disabled"


@pytest.mark.parametrize("url", [
    "http://media.example/cat.png", "ftp://media.example/cat.png", "file:///etc/passwd", "gopher://x/",
    "media.example/cat.png", "//media.example/cat.png",
    "https://user:secret@media.example/cat.png", "https://user@media.example/cat.png",
    "https://evil.example\\@media.example/", "https:///cat.png", "https://media.example:99999/",
    "https://media.example:0/", "https://media.example:port/", "https://media example/", "https://[::1/",
    "https://exa$mple.com/", "https://media.example/cat png", "https://media.example/\r\nX-Evil: 1",
])
async def test_bad_urls(url):
    with trio.fail_after(LIMIT):
        assert (await refused(guarded([]), url)).code == "bad_url"


REFUSED_ADDRESSES = [
    "127.0.0.1", "127.1.2.3", "::1", "10.0.0.1", "10.255.255.255", "192.168.1.1", "172.16.0.1",
    "172.31.255.255", "169.254.169.254", "fe80::1", "224.0.0.1", "239.255.255.250", "ff02::1", "ff0e::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "0.0.0.0", "::", "100.64.0.1",
    "192.0.2.1", "198.51.100.7", "203.0.113.9", "198.18.0.1", "192.0.0.8", "240.0.0.1", "255.255.255.255",
    "2001:db8::1", "fc00::1", "fd00:ec2::254", "fec0::1", "2002:7f00:1::", "2002:a00:1::",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2", "64:ff9b::7f00:1", "::7f00:1",
]


@pytest.mark.parametrize("ip", REFUSED_ADDRESSES)
async def test_literal_addresses_refused(ip):
    host = f"[{ip}]" if ":" in ip else ip
    with trio.fail_after(LIMIT):
        assert (await refused(guarded([]), f"https://{host}/cat.png")).code == "address_not_allowed"


@pytest.mark.parametrize("addresses", [
    ["127.0.0.1", "::1"], ["::1"], ["10.0.0.1"], ["192.168.0.10"], ["172.16.5.4"], ["169.254.169.254"],
    ["fe80::1"], ["224.0.0.251"], ["::ffff:127.0.0.1"], [PUBLIC, "10.0.0.1"], [PUBLIC, "::1"],
    ["not-an-address"],
])
async def test_resolved_addresses_refused_if_any_is_not_public(addresses):
    with trio.fail_after(LIMIT):
        assert (await refused(guarded(addresses), "https://localhost/cat.png")).code == "address_not_allowed"


async def test_default_resolver_refuses_localhost():
    with trio.fail_after(LIMIT):
        fetcher = MediaFetcher(allow_urls=True, connect=never_connect, ssl_context=SYSTEM_TRUST)
        assert (await refused(fetcher, "https://localhost/cat.png")).code == "address_not_allowed"


@pytest.mark.parametrize("ip", [PUBLIC, "8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:93.184.216.34"])
def test_public_addresses_pass(ip):
    assert is_public(ipaddress.ip_address(ip))


# Fetching from the local HTTPS server

@pytest.mark.parametrize("path, kind, body", [
    ("/cat.png", "image", PNG), ("/cat.jpg", "image", JPEG), ("/clip.mp4", "video", MP4),
])
async def test_fetch_through_the_checks(server, path, kind, body):
    with trio.fail_after(LIMIT):
        assert await server.fetcher().fetch(f"https://media.example{path}", kind) == body
    assert server.resolved == ["media.example"]
    assert server.connects == [(PUBLIC, 443)]
    headers = server.headers()
    assert server.requests[0].method == b"GET" and server.requests[0].target == path.encode()
    assert headers["host"] == "media.example"
    assert headers["accept"] == ("image/jpeg, image/png" if kind == "image" else "video/mp4")
    assert headers["connection"] == "close" and headers["user-agent"]


async def test_port_and_query_reach_the_server(server):
    with trio.fail_after(LIMIT):
        assert await server.fetcher().fetch("https://media.example:8443/cat.png?size=2", "image") == PNG
    assert server.connects == [(PUBLIC, 8443)]
    assert server.headers()["host"] == "media.example:8443"
    assert server.requests[0].target == b"/cat.png?size=2"


async def test_connects_to_the_address_it_checked(server):
    answers = iter([[PUBLIC], ["127.0.0.1"]])  # a rebinding resolver: public first, loopback after

    async def rebinding(host: str, port: int) -> list[str]:
        server.resolved.append(host)
        return next(answers)

    with trio.fail_after(LIMIT):
        assert await replace(server.fetcher(), resolve=rebinding).fetch("https://media.example/cat.png",
                                                                        "image") == PNG
    assert server.resolved == ["media.example"] and server.connects == [(PUBLIC, 443)]


async def test_body_without_content_length_up_to_the_limit(server):
    with trio.fail_after(LIMIT):
        fetched = await server.fetcher(max_bytes=len(PNG)).fetch("https://media.example/chunked.png", "image")
    assert fetched == PNG


async def test_certificate_is_verified(server):
    with trio.fail_after(LIMIT):
        untrusting = replace(server.fetcher(), ssl_context=SYSTEM_TRUST)
        assert (await refused(untrusting, "https://media.example/cat.png")).code == "fetch_failed"
        assert (await refused(server.fetcher(), "https://other.example/cat.png")).code == "fetch_failed"
    assert server.requests == []


async def test_unknown_host_fails_to_fetch(server):
    with trio.fail_after(LIMIT):
        assert (await refused(server.fetcher(), "https://nowhere.example/cat.png")).code == "fetch_failed"


async def test_redirects_followed_up_to_the_limit(server):
    with trio.fail_after(LIMIT):
        assert await server.fetcher(max_redirects=3).fetch("https://media.example/hop/3", "image") == PNG
    assert [r.target for r in server.requests] == [b"/hop/3", b"/hop/2", b"/hop/1", b"/hop/0"]
    assert server.resolved == ["media.example"] * 4  # every hop resolved and checked again


async def test_too_many_redirects(server):
    with trio.fail_after(LIMIT):
        refusal = await refused(server.fetcher(max_redirects=3), "https://media.example/hop/4")
    assert refusal.code == "too_many_redirects"
    assert [r.target for r in server.requests] == [b"/hop/4", b"/hop/3", b"/hop/2", b"/hop/1"]


@pytest.mark.parametrize("location, code", [
    ("https://internal.example/cat.png", "address_not_allowed"),
    ("https://127.0.0.1/cat.png", "address_not_allowed"),
    ("https://169.254.169.254/latest/meta-data/", "address_not_allowed"),
    ("https://[::ffff:10.0.0.1]/cat.png", "address_not_allowed"),
    ("http://media.example/cat.png", "bad_url"),
    ("file:///etc/passwd", "bad_url"),
    ("data:image/png;base64,iVBORw==", "bad_url"),
])
async def test_redirect_checked_from_the_start(server, location, code):
    url = "https://media.example/redirect?" + f"to={location}".replace("&", "%26")
    with trio.fail_after(LIMIT):
        assert (await refused(server.fetcher(), url)).code == code
    assert server.connects == [(PUBLIC, 443)]


async def test_declared_oversize_refused_before_the_body(server):
    with trio.fail_after(LIMIT):
        refusal = await refused(server.fetcher(max_bytes=4096), "https://media.example/huge-declared")
        assert refusal.code == "media_too_large"
        await server.gone["/huge-declared"].wait()


async def test_streamed_oversize_stops_reading(server):
    # The server sends forever: the fetch can only end by refusing as soon as the limit is passed.
    with trio.fail_after(LIMIT):
        refusal = await refused(server.fetcher(max_bytes=4096), "https://media.example/huge-streamed")
        assert refusal.code == "media_too_large"
        await server.gone["/huge-streamed"].wait()


async def test_slow_body_ends_at_the_time_limit(server):
    with trio.fail_after(LIMIT):
        start = trio.current_time()
        refusal = await refused(server.fetcher(timeout=0.5), "https://media.example/trickle")
        assert refusal.code == "media_timeout"
        assert 0.5 <= trio.current_time() - start < 1.5
        await server.gone["/trickle"].wait()


async def test_callers_shorter_deadline_wins(server):
    with trio.fail_after(LIMIT):
        start = trio.current_time()
        with trio.move_on_after(0.2) as scope:
            await server.fetcher(timeout=5).fetch("https://media.example/trickle", "image")
        assert scope.cancelled_caught and trio.current_time() - start < 1.5


@pytest.mark.parametrize("path, kind", [
    ("/page.html", "image"), ("/untyped", "image"), ("/cat.png", "video"), ("/clip.mp4", "image"),
    ("/gzipped.png", "image"),
])
async def test_wrong_content_type(server, path, kind):
    with trio.fail_after(LIMIT):
        assert (await refused(server.fetcher(), f"https://media.example{path}", kind)).code == "bad_content_type"


async def test_bad_status_names_the_status_in_the_detail(server):
    with trio.fail_after(LIMIT):
        refusal = await refused(server.fetcher(), "https://media.example/missing")
    assert refusal.code == "bad_status" and "404" in refusal.detail and "404" not in refusal.code


async def test_refusal_carries_the_parameter_path():
    param = "messages[0].content[1].image_url.url"
    with trio.fail_after(LIMIT):
        with pytest.raises(MediaRefused) as caught:
            await offline().fetch("https://media.example/cat.png", "image", param=param)
    assert caught.value.code == "media_urls_disabled" and caught.value.param == param


# Concurrency

async def test_fetch_all_in_order(server):
    parts = [("https://media.example/cat.png", "image"), MediaPart(data_url("video/mp4", MP4), "video"),
             ("https://media.example/clip.mp4", "video"), ("https://media.example/cat.jpg", "image")]
    with trio.fail_after(LIMIT):
        assert await server.fetcher().fetch_all(parts) == [PNG, MP4, MP4, JPEG]


async def test_fetch_all_first_refusal_cancels_the_others(server):
    parts = [MediaPart("https://media.example/hang", "image", "images[0]"),
             MediaPart("https://media.example/missing-after-hang", "image", "images[1]")]
    with trio.fail_after(LIMIT):
        with pytest.raises(MediaRefused) as caught:  # the refusal itself, not an ExceptionGroup
            await server.fetcher().fetch_all(parts)
        await server.gone["/hang"].wait()
    assert caught.value.code == "bad_status" and caught.value.param == "images[1]"


async def test_fetch_all_cancelled_with_the_caller(server):
    parts = [("https://media.example/hang?a", "image"), ("https://media.example/hang?b", "image")]
    with trio.fail_after(LIMIT):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(server.fetcher().fetch_all, parts)
                await server.started["/hang?a"].wait()
                await server.started["/hang?b"].wait()
                scope.cancel()
        await server.gone["/hang?a"].wait()
        await server.gone["/hang?b"].wait()
