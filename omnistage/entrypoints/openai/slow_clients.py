"""Bounds on what a slow or greedy client may hold open: a deadline for a request's headers, a
deadline for its body, and a cap on the connections one client address keeps open at once.

    connection made ──> over the address's cap? ──> 429 written, closed
         │
         └─ header timer ─(headers complete)─> request runs ─(response sent)─> header timer ...
              └─ fires: closed, no answer (nothing was asked yet)

    body: the whole body within body_timeout_s of the request's start, else 408 and closed

uvicorn's `timeout_keep_alive` only closes a connection idle between two requests, and nothing
of its own times out one that stops halfway through its headers, so the header timer and the
per-address count live in a subclass of uvicorn's HTTP protocol (`guarded_protocol`), handed to
uvicorn as its `http` class. The body deadline is ASGI middleware (`BodyTimeout`). Behind a
reverse proxy every connection comes from the proxy's address: there the cap is 0 (none) and
the proxy bounds clients.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.auto import AutoHTTPProtocol

_TOO_MANY = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
             b"connection: close\r\ncontent-length: %d\r\n\r\n%s")
_TOO_MANY_BODY = (b'{"error": {"message": "too many open connections from your address", '
                  b'"type": "rate_limit_error", "param": null, "code": "too_many_connections"}}')


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0            # connection open or idle to headers complete
    body_timeout_s: float = 60.0              # request start to the body's last byte
    max_connections_per_client: int = 64      # open at once from one address; 0: no cap

    def __post_init__(self) -> None:
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("header_timeout_s / body_timeout_s: must be > 0")
        if self.max_connections_per_client < 0:
            raise ValueError(f"max_connections_per_client={self.max_connections_per_client}: "
                             "must be >= 0 (0: no cap)")


def guarded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with the header deadline and the per-address cap; one class per
    server, whose connections share one count."""
    open_by_address: Counter[str] = Counter()

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _timer: asyncio.TimerHandle | None = None
        _address: str | None = None
        _waiting_after: Any = None            # the cycle done when the timer was armed

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._address = self.client[0] if self.client else None
            if self._address is not None:
                open_by_address[self._address] += 1
                cap = limits.max_connections_per_client
                if cap and open_by_address[self._address] > cap:
                    transport.write(_TOO_MANY % (len(_TOO_MANY_BODY), _TOO_MANY_BODY))
                    transport.close()
                    return
            self._arm(None)

        def connection_lost(self, exc: Exception | None) -> None:
            self._release()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._timer is not None and self.cycle is not self._waiting_after:
                self._disarm()                # a new request's headers are in

        def on_response_complete(self) -> None:
            done = self.cycle
            super().on_response_complete()
            if self.cycle is done and not self.transport.is_closing():
                self._arm(done)               # no pipelined request started: wait for one

        def handle_websocket_upgrade(self, *args: Any) -> None:
            self._release()                   # the WebSocket protocol owns the socket now
            super().handle_websocket_upgrade(*args)

        def _arm(self, done: Any) -> None:
            self._disarm()
            self._waiting_after = done
            self._timer = self.loop.call_later(limits.header_timeout_s, self.transport.close)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _release(self) -> None:
            self._disarm()
            if self._address is not None:
                open_by_address[self._address] -= 1
                if open_by_address[self._address] <= 0:
                    del open_by_address[self._address]
                self._address = None

    return GuardedHTTPProtocol


class BodyTimeout:
    """408 (and the connection closed) for a body not fully received within `timeout_s` of the
    request's start: a body trickled in a byte at a time holds a connection and a task no
    longer than that. Once the body is in, `receive` (a wait for the client's disconnect)
    has no deadline."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline, body_done = loop.time() + self.timeout_s, False

        async def timed() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise StarletteHTTPException(
                    408, f"the request body did not arrive within {self.timeout_s:g} s",
                    headers={"Connection": "close"}) from None
            body_done = message["type"] != "http.request" or not message.get("more_body")
            return message

        await self.app(scope, timed, send)
