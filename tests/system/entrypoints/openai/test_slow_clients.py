"""Slow and greedy clients against a real server (slow_clients.py) with short limits: half-sent
headers are cut at the header deadline, a trickled body gets 408 at the body deadline, one
address holds at most its cap of connections, and everyone else is served meanwhile. The
server reads its API key from a file, so the key is not on its command line."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import httpx
import pytest

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, CAP = 1.0, 1.0, 4
KEY = "key-from-a-file"


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
           ) -> Server:
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    started = start_server(["--header-timeout", str(HEADER_TIMEOUT_S),
                            "--body-timeout", str(BODY_TIMEOUT_S),
                            "--max-connections-per-client", str(CAP),
                            "--api-key-file", str(key_file)])
    started.api_key = KEY
    return started


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def read_until_closed(sock: socket.socket, limit_s: float) -> bytes:
    """What the server sends until it closes the connection (TimeoutError past `limit_s`)."""
    data, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], deadline - time.monotonic())
        if ready:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return data
            if not chunk:
                return data
            data += chunk
    raise TimeoutError(f"still open after {limit_s} s; got {data[:200]!r}")


def served_elsewhere(server: Server) -> None:
    """A client from another loopback address is served."""
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport, timeout=5) as client:
        assert client.get(f"{server.url}/health").status_code == 200


def test_half_sent_headers_are_cut_at_the_header_timeout(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")     # no blank line: stalls
        start = time.monotonic()
        served_elsewhere(server)
        assert read_until_closed(sock, HEADER_TIMEOUT_S + 3) == b""
        assert time.monotonic() - start >= HEADER_TIMEOUT_S - 0.2


def test_an_idle_keep_alive_connection_that_stalls_mid_headers_is_cut(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")                 # the next request stalls
        assert read_until_closed(sock, HEADER_TIMEOUT_S + 3) == b""


def test_a_trickled_body_is_cut_with_408(server: Server) -> None:
    with connect(server) as sock:
        sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
        start, answer = time.monotonic(), b""
        while not answer and time.monotonic() - start < BODY_TIMEOUT_S + 3:
            sock.sendall(b" ")                                     # a byte every 0.2 s
            ready, _, _ = select.select([sock], [], [], 0.2)
            answer = read_until_closed(sock, 3) if ready else b""
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"did not arrive within" in answer
        assert time.monotonic() - start >= BODY_TIMEOUT_S - 0.2
    served_elsewhere(server)


def test_connections_over_the_cap_from_one_address_are_refused(server: Server) -> None:
    held = [connect(server) for _ in range(CAP)]
    try:
        time.sleep(0.2)                      # the server has counted them
        with connect(server) as extra:
            answer = read_until_closed(extra, 3)
        assert answer.startswith(b"HTTP/1.1 429") and b"too_many_connections" in answer
        served_elsewhere(server)
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert server.get("/health").status_code == 200     # freed: this address is served again


def test_the_key_comes_from_the_file_and_is_not_on_the_command_line(server: Server) -> None:
    assert httpx.get(f"{server.url}/v1/models", timeout=5).status_code == 401
    assert server.get("/v1/models").status_code == 200
    assert KEY.encode() not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
