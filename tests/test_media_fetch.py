"""media_fetch's checks before any connection: strict data URLs, URLs refused without the flag or when
malformed, and addresses refused unless every one a name resolves to is public. The fetches themselves,
through a local HTTPS server, are in test_media_fetch_server.py.
"""

import ipaddress

import pytest
import trio

from lanes.http.media_fetch import MediaFetcher, is_public
from media_server import JPEG, LIMIT, MP4, PNG, PUBLIC, SYSTEM_TRUST, data_url, guarded, never_connect, offline, refused

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
