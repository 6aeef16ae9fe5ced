"""The bytes behind an image or video part's URL: a strict data URL, or (with `--vision-urls`) a public
HTTPS URL fetched over a socket to the very address that was checked.

Every refusal is a `MediaRefused` with a stable `code`; the HTTP layer words them. A fetch follows a bounded
number of redirects, checks every hop from the start (scheme, host, resolution, addresses), stops reading as
soon as the size limit is passed, and ends at its time limit, which nests inside the caller's own deadline.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple
from urllib.parse import SplitResult, quote, urljoin, urlsplit

import h11
import trio

Kind = Literal["image", "video"]
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], Awaitable[Sequence[str]]]
Connect = Callable[[str, int], Awaitable[trio.abc.Stream]]

CONTENT_TYPES: dict[str, tuple[str, ...]] = {"image": ("image/jpeg", "image/png"), "video": ("video/mp4",)}
REDIRECTS = (301, 302, 303, 307, 308)
USER_AGENT = "lanes-media-fetch"
CODES = (
    "media_urls_disabled", "bad_url", "address_not_allowed", "too_many_redirects", "media_too_large",
    "media_timeout", "bad_status", "bad_content_type", "bad_data_url", "fetch_failed",
)

# Ranges refused by name, so the check does not hang on one Python release's idea of `is_global`.
_REFUSED = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "192.0.2.0/24", "198.18.0.0/15", "198.51.100.0/24",
    "203.0.113.0/24", "240.0.0.0/4", "2001:db8::/32", "fc00::/7", "fec0::/10",
))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_HOSTNAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")
_CHUNK = 65536


class MediaRefused(Exception):
    """A part's media refused: `code` is one of `CODES` and never changes; `detail` says what was seen (a
    status, a type, an address) for logs; `param` is the request's parameter path when the caller gave one."""

    def __init__(self, code: str, detail: str = "", param: str | None = None):
        assert code in CODES, code
        super().__init__(f"{code}: {detail}" if detail else code)
        self.code = code
        self.detail = detail
        self.param = param


@dataclass(frozen=True)
class FetchLimits:
    """Bounds on one part: decoded bytes, seconds for the whole fetch (redirects included), redirects followed."""

    max_bytes: int = 20 * 2**20
    timeout: float = 10.0
    max_redirects: int = 3


class MediaPart(NamedTuple):
    """One part to fetch; a plain `(url, kind)` tuple is taken as one with no parameter path."""

    url: str
    kind: Kind
    param: str | None = None


def is_public(ip: Address) -> bool:
    """True only for an address that is globally reachable unicast: never private, loopback, link-local,
    multicast, reserved, unspecified, shared, documentation or benchmark, nor an IPv6 form embedding one."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public(ip.ipv4_mapped)
        embedded = ip.sixtofour or (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None)
        if embedded is not None and not is_public(embedded):
            return False
        if ip.teredo is not None or ip.is_site_local:
            return False
    if any(ip in network for network in _REFUSED if network.version == ip.version):
        return False
    return ip.is_global and not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
                                 or ip.is_reserved or ip.is_unspecified)


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for `host`, in its order, without duplicates."""
    infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def open_tcp(ip: str, port: int) -> trio.abc.Stream:
    """A TCP stream to the literal address `ip` (no name is looked up)."""
    return await trio.open_tcp_stream(ip, port)


def decode_data_url(url: str, kind: Kind, max_bytes: int) -> bytes:
    """The bytes of `data:<type>[;param=value]*;base64,<payload>`, with <type> one of the kind's content
    types; the size is checked on the encoded length before anything is decoded, then on the decoded one."""
    header, comma, payload = url[len("data:"):].partition(",")
    fields = header.split(";")
    if not comma or len(fields) < 2 or fields[-1].lower() != "base64":
        raise MediaRefused("bad_data_url", "not a base64 data URL")
    media_type = fields[0].strip().lower()
    if media_type not in CONTENT_TYPES[kind]:
        raise MediaRefused("bad_data_url", f"media type {media_type!r} for {kind}")
    if len(payload) > 4 * -(-max_bytes // 3):
        raise MediaRefused("media_too_large", f"over {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaRefused("bad_data_url", "payload is not valid base64") from None
    if not data:
        raise MediaRefused("bad_data_url", "empty payload")
    if len(data) > max_bytes:
        raise MediaRefused("media_too_large", f"{len(data)} bytes, over {max_bytes}")
    return data


def joined(base: str, location: str) -> str:
    """A redirect's Location resolved against the URL that gave it; one urljoin cannot parse is a bad URL."""
    try:
        return urljoin(base, location)
    except ValueError:
        raise MediaRefused("bad_url", "malformed Location in a redirect") from None


@dataclass(frozen=True)
class Target:
    """One hop's checked URL: the host as sent (SNI and Host), its port, the request target."""

    url: str
    host: str
    port: int
    path: str

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == 443 else f"{host}:{self.port}"


def check_url(url: str) -> Target:
    """`url` split and checked: https only, no userinfo, a DNS name or literal IP, a port in range."""
    if any(c <= " " or c == "\x7f" for c in url):
        raise MediaRefused("bad_url", "whitespace or control characters")
    try:
        parts: SplitResult = urlsplit(url)
        port = 443 if parts.port is None else parts.port
    except ValueError:
        raise MediaRefused("bad_url", "malformed URL") from None
    if port == 0:
        raise MediaRefused("bad_url", "port 0")
    if parts.scheme != "https":
        raise MediaRefused("bad_url", f"scheme {parts.scheme!r}")
    if "@" in parts.netloc:
        raise MediaRefused("bad_url", "userinfo in the URL")
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise MediaRefused("bad_url", "host is not a valid name") from None
        if not _HOSTNAME.fullmatch(host):
            raise MediaRefused("bad_url", "no valid host")
    # Printable ASCII stays as the client wrote it; anything else is percent-encoded.
    path = quote(parts.path or "/", safe="".join(map(chr, range(33, 127))))
    query = quote(parts.query, safe="".join(map(chr, range(33, 127))))
    return Target(url, host, port, f"{path}?{query}" if query else path)


@dataclass(frozen=True)
class MediaFetcher:
    """Turns a part's URL into its bytes, or raises `MediaRefused`. Data URLs are always read; other URLs
    only when `allow_urls` (the server's `--vision-urls`). `resolve`, `connect` and `ssl_context` are there
    for tests: the address checks are the same whatever they are."""

    allow_urls: bool = False
    limits: FetchLimits = FetchLimits()
    resolve: Resolve = resolve_host
    connect: Connect = open_tcp
    ssl_context: ssl.SSLContext = field(default_factory=ssl.create_default_context)

    async def fetch(self, url: str, kind: Kind, *, param: str | None = None) -> bytes:
        """The part's bytes, within `limits`; a refusal carries `param`. Cancelled with the caller, whose own
        deadline wins when it is shorter than `limits.timeout`."""
        try:
            if url[:5].lower() == "data:":
                return decode_data_url(url, kind, self.limits.max_bytes)
            if not self.allow_urls:
                raise MediaRefused("media_urls_disabled")
            try:
                with trio.fail_after(self.limits.timeout):
                    return await self._follow(url, kind)
            except trio.TooSlowError:
                raise MediaRefused("media_timeout", f"over {self.limits.timeout} s") from None
        except MediaRefused as refusal:
            refusal.param = param
            raise

    async def fetch_all(self, parts: Sequence[MediaPart | tuple[str, Kind]]) -> list[bytes]:
        """Every part's bytes, in order, fetched concurrently. The first refusal cancels the other fetches and
        is raised as itself (never inside an ExceptionGroup); cancelling the caller cancels them all."""
        results: list[bytes] = [b""] * len(parts)
        refusals: list[MediaRefused] = []

        # Each task catches its own refusal, so the nursery never wraps one in an ExceptionGroup.
        async def one(i: int, part: MediaPart) -> None:
            try:
                results[i] = await self.fetch(part.url, part.kind, param=part.param)
            except MediaRefused as refusal:
                refusals.append(refusal)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for i, part in enumerate(parts):
                nursery.start_soon(one, i, MediaPart(*part))
        if refusals:
            raise refusals[0]
        return results

    async def _follow(self, url: str, kind: Kind) -> bytes:
        for _ in range(self.limits.max_redirects + 1):
            target = check_url(url)
            status, location, body = await self._get(target, kind)
            if status not in REDIRECTS:
                return body
            if location is None:
                raise MediaRefused("bad_status", f"{status} without a Location")
            url = joined(target.url, location)
        raise MediaRefused("too_many_redirects", f"more than {self.limits.max_redirects}")

    async def _checked_addresses(self, target: Target) -> list[str]:
        try:
            literal = ipaddress.ip_address(target.host)
        except ValueError:
            literal = None
        if literal is not None:
            names = [target.host]
        else:
            try:
                names = list(await self.resolve(target.host, target.port))
            except OSError as error:
                raise MediaRefused("fetch_failed", f"cannot resolve {target.host}: {error}") from None
        if not names:
            raise MediaRefused("fetch_failed", f"{target.host} has no address")
        for name in names:
            try:
                ip = ipaddress.ip_address(name)
            except ValueError:
                raise MediaRefused("address_not_allowed", f"{target.host} gave {name!r}") from None
            if not is_public(ip):
                raise MediaRefused("address_not_allowed", f"{target.host} is {ip}")
        return names

    async def _open(self, target: Target) -> trio.SSLStream:
        errors = []
        for ip in await self._checked_addresses(target):
            try:
                tcp = await self.connect(ip, target.port)
            except OSError as error:
                errors.append(f"{ip}: {error}")
                continue
            return trio.SSLStream(tcp, self.ssl_context, server_hostname=target.host, https_compatible=True)
        raise MediaRefused("fetch_failed", "cannot connect: " + "; ".join(errors))

    async def _get(self, target: Target, kind: Kind) -> tuple[int, str | None, bytes]:
        """One GET: (status, Location, b"") for a redirect, else (status, None, body) once every check passed."""
        stream = await self._open(target)
        try:
            return await self._exchange(stream, target, kind)
        except (trio.BrokenResourceError, h11.RemoteProtocolError, OSError) as error:
            cause = error.__cause__ or error
            raise MediaRefused("fetch_failed", f"{type(cause).__name__}: {cause}") from None
        finally:
            await trio.aclose_forcefully(stream)

    async def _exchange(self, stream: trio.SSLStream, target: Target, kind: Kind) -> tuple[int, str | None, bytes]:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="GET", target=target.path, headers=[
            ("Host", target.host_header), ("User-Agent", USER_AGENT), ("Accept", ", ".join(CONTENT_TYPES[kind])),
            ("Accept-Encoding", "identity"), ("Connection", "close"),
        ])
        await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
        response = await self._next(stream, conn)
        while isinstance(response, h11.InformationalResponse):
            response = await self._next(stream, conn)
        if not isinstance(response, h11.Response):
            raise MediaRefused("fetch_failed", "the connection closed before a response")
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in response.headers}
        if response.status_code in REDIRECTS:
            return response.status_code, headers.get("location"), b""
        if not 200 <= response.status_code < 300:
            raise MediaRefused("bad_status", f"status {response.status_code}")
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type not in CONTENT_TYPES[kind]:
            raise MediaRefused("bad_content_type", f"{media_type or 'no content type'} for {kind}")
        if headers.get("content-encoding", "identity").lower() != "identity":
            raise MediaRefused("bad_content_type", f"content-encoding {headers['content-encoding']}")
        max_bytes = self.limits.max_bytes
        if int(headers.get("content-length", 0)) > max_bytes:
            raise MediaRefused("media_too_large", f"content-length {headers['content-length']}, over {max_bytes}")
        return response.status_code, None, await self._body(stream, conn, max_bytes)

    async def _body(self, stream: trio.SSLStream, conn: h11.Connection, max_bytes: int) -> bytes:
        body = bytearray()
        while True:
            event = await self._next(stream, conn)
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > max_bytes:
                    raise MediaRefused("media_too_large", f"body over {max_bytes} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:
                raise MediaRefused("fetch_failed", "the connection closed inside the body")

    @staticmethod
    async def _next(stream: trio.SSLStream, conn: h11.Connection) -> h11.Event:
        while (event := conn.next_event()) is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(_CHUNK))
        return event
