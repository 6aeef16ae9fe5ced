"""media_fetch: public HTTPS URLs fetched with every hop's addresses checked (the checks made before any
connection are in test_media_fetch.py).

Rules: a local HTTPS server on 127.0.0.1 port 0 with a trustme certificate for "media.example", speaking
h11; the fetcher's production checks are never loosened: the test injects a resolver that names public
addresses and a connect function that routes those public addresses (and only those) to the local server.
Every test runs under `trio.fail_after`; events set by the server's handler (never sleeps) say when it has
started answering or seen the client go; time limits are real and a fraction of a second.
"""

import ssl
from dataclasses import replace
from functools import partial

import pytest
import trio
import trustme

from lanes.http.media_fetch import MediaPart, MediaRefused
from media_server import JPEG, LIMIT, MP4, PNG, PUBLIC, SYSTEM_TRUST, MediaServer, data_url, offline, refused


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
    ("https://[::1/x.png", "bad_url"),  # urljoin raises ValueError on these: a refusal, never a 500
    ("//[zz]/x.png", "bad_url"),
    ("//[::1", "bad_url"),
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
