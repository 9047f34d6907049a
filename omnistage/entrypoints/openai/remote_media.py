"""Fetching an http(s) media URL (`--allow-remote-media`) without letting a request reach what
only the server can reach: loopback, private, link-local (cloud metadata at 169.254.169.254),
shared, reserved or multicast addresses.

    for each hop (the URL, then each redirect, at most MAX_REDIRECTS):
        resolve the host ─> every address public? ─> connect to that checked address
        (never a second lookup: a DNS answer that changes between check and connect
        cannot move the request) ─> TLS verified against the host name ─> 3xx: next hop

Whatever keeps a public host from answering (refused, unreachable, reset, timed out, no such
host) gets one message, so that an error cannot tell which ports are open anywhere.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse

MAX_REDIRECTS = 5
UNREACHABLE = "the host did not answer (unreachable, refused or timed out)"


class FetchError(Exception):
    """Why a URL gave no media, in words fit for the client."""


def is_public(ip: str) -> bool:
    """An address on the public Internet: not loopback, private, link-local, shared (CGNAT),
    reserved, multicast or unspecified; an IPv6 address that maps or embeds an IPv4 one
    is judged by that."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address):
        inner = addr.ipv4_mapped or addr.sixtofour or (addr.teredo or (None, None))[1]
        if inner is not None and not is_public(str(inner)):
            return False
    return addr.is_global and not addr.is_multicast


def resolve_public(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, all checked public (FetchError otherwise)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise FetchError(UNREACHABLE) from None
    ips = list(dict.fromkeys(info[4][0] for info in infos))
    if not ips or not all(is_public(ip) for ip in ips):
        raise FetchError("the URL's host is not a public address (loopback, private, "
                         "link-local and metadata addresses are refused)")
    return ips


def _pinned(conn_class: type[http.client.HTTPConnection], ip: str
            ) -> type[http.client.HTTPConnection]:
    """`conn_class` connecting to `ip` whatever its host name resolves to now (the Host
    header and TLS's name check still use the host name)."""

    class Pinned(conn_class):  # type: ignore[valid-type, misc]
        def connect(self) -> None:
            self._create_connection = lambda address, *a, **kw: connect((ip, address[1]),
                                                                        *a, **kw)
            super().connect()

    return Pinned


def connect(address: tuple[str, int], timeout: float, *args: object) -> socket.socket:
    """A TCP connection to an address already checked public."""
    return socket.create_connection(address, timeout, *args)  # type: ignore[arg-type]


def fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    """The body behind `url` (at most `max_bytes` + 1 bytes read: the caller tells a body
    over the limit by its length), following redirects hop by hop, each hop's host checked."""
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise FetchError("a redirect led to a URL that is not http(s)")
        status, location, body = _get(parsed, max_bytes, deadline)
        if location is None:
            if status != 200:
                raise FetchError(f"the server answered HTTP {status}")
            return body
        url = urllib.parse.urljoin(url, location)
    raise FetchError(f"more than {MAX_REDIRECTS} redirects")


def _get(parsed: urllib.parse.SplitResult, max_bytes: int, deadline: float
         ) -> tuple[int, str | None, bytes]:
    """One hop: (status, the redirect's Location or None, the body)."""
    https = parsed.scheme == "https"
    try:
        port = parsed.port or (443 if https else 80)
    except ValueError:
        raise FetchError("the URL's port is not a number from 0 to 65535") from None
    ip = resolve_public(parsed.hostname or "", port)[0]
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise FetchError(UNREACHABLE)
    base = http.client.HTTPSConnection if https else http.client.HTTPConnection
    kw = {"context": ssl.create_default_context()} if https else {}
    conn = _pinned(base, ip)(parsed.hostname, port, timeout=remaining, **kw)
    try:
        conn.request("GET", urllib.parse.urlunsplit(("", "", parsed.path or "/", parsed.query,
                                                     "")), headers={"User-Agent": "omnistage"})
        resp = conn.getresponse()
        if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
            return resp.status, resp.getheader("Location"), b""
        return resp.status, None, _read(resp, max_bytes, deadline) if resp.status == 200 else b""
    except ssl.SSLError:
        raise FetchError("the host's TLS certificate could not be verified") from None
    except (OSError, http.client.HTTPException):
        raise FetchError(UNREACHABLE) from None
    finally:
        conn.close()


def _read(resp: http.client.HTTPResponse, max_bytes: int, deadline: float) -> bytes:
    """At most `max_bytes` + 1 bytes of the body, all of it by the deadline: a body trickled
    in holds a preparation thread no longer than the fetch's timeout."""
    chunks, size = [], 0
    while size <= max_bytes:
        if time.monotonic() > deadline:
            raise FetchError(UNREACHABLE)
        chunk = resp.read1(min(1 << 16, max_bytes + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
