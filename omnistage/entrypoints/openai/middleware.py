"""The server's ASGI layers before any route: the body size limit, the API key (a header, or
a WebSocket subprotocol for browsers), the count of requests per route and status, and
`add_middleware`, which stacks them (with the body deadline, slow_clients.py, and CORS)."""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.metrics import ServerMetrics
from omnistage.entrypoints.openai.slow_clients import BodyTimeout

KEY_PROTOCOL = "openai-insecure-api-key."     # a WebSocket subprotocol carrying the API key
OPEN_PATHS = {"/health", "/"}                  # served without the API key: liveness, the page
# the page's script and styles; images answered as URLs (unguessable, short-lived: image_files.py)
OPEN_PREFIX = ("/playground/", "/v1/images/files/")


# ---- middleware ------------------------------------------------------------------------------

class BodyLimit:
    """413 for a body over the limit: at once from Content-Length, else while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is larger than {self.max_bytes} bytes",
                             code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await too_large.response()(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # FastAPI passes HTTPExceptions from body reading on
                    raise StarletteHTTPException(413, too_large.message)
            return message

        await self.app(scope, limited, send)


class APIKeyCheck:
    """With an API key set, every path but the open ones (/health, the playground page and its
    files, /metrics with --open-metrics) needs `Authorization: Bearer KEY`, WebSockets too:
    /metrics, /docs and /openapi.json say more about the server than a stranger should see.
    A browser's WebSocket cannot send headers: there the key may come as the subprotocol
    `openai-insecure-api-key.KEY`, as OpenAI's browser clients send it (the playground does)."""

    def __init__(self, app: ASGIApp, api_key: str | None, open_metrics: bool = False) -> None:
        self.app, self.api_key = app, api_key
        self.open_paths = OPEN_PATHS | ({"/metrics"} if open_metrics else set())

    def is_open(self, path: str) -> bool:
        return path in self.open_paths or path.startswith(OPEN_PREFIX)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        offered_key = None
        if scope["type"] == "websocket":
            scope, send, offered_key = _take_key_protocol(scope, send)
        if (self.api_key is None or scope["type"] not in ("http", "websocket")
                or scope.get("method") == "OPTIONS" or self.is_open(scope["path"])):
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else offered_key
        if token is None or not hmac.compare_digest(token.encode(), self.api_key.encode()):
            if scope["type"] == "websocket":     # refused before the handshake: HTTP 403
                return await send({"type": "websocket.close", "code": 1008})
            err = APIError(401, "missing or wrong API key: send Authorization: Bearer KEY",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await err.response()(scope, receive, send)
        await self.app(scope, receive, send)


def _take_key_protocol(scope: Scope, send: Send) -> tuple[Scope, Send, str | None]:
    """The key offered as a WebSocket subprotocol, taken out of the list the route sees (no
    route echoes it back); a handshake whose route picks no protocol answers the first one left,
    since a browser drops a handshake that answers none of those it offered."""
    offered = scope.get("subprotocols", [])
    keys = [p[len(KEY_PROTOCOL):] for p in offered if p.startswith(KEY_PROTOCOL)]
    if not keys:
        return scope, send, None
    rest = [p for p in offered if not p.startswith(KEY_PROTOCOL)]

    async def answer(message: Message) -> None:
        if message["type"] == "websocket.accept" and not message.get("subprotocol") and rest:
            message = {**message, "subprotocol": rest[0]}
        await send(message)

    return {**scope, "subprotocols": rest}, answer, keys[0]


class CountRequests:
    """omnistage_http_requests_total{route, status}; unknown paths share one label."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: set[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.requests.labels(route, str(status)).inc()


def add_middleware(app: FastAPI, api_key: str | None, open_metrics: bool, max_body_bytes: int,
                   body_timeout_s: float, allowed_origins: tuple[str, ...],
                   metrics: ServerMetrics) -> None:
    """The layers every request passes before its route (the order of the server's
    docstring, outermost last added)."""
    routes = {r.path for r in app.routes if hasattr(r, "path")}
    app.add_middleware(APIKeyCheck, api_key=api_key, open_metrics=open_metrics)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(BodyTimeout, timeout_s=body_timeout_s)
    app.add_middleware(CountRequests, metrics=metrics, routes=routes)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
