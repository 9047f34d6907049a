"""What a request sent that the server accepted and ignored, told in its answer's headers.

Every accepted field with no effect goes through one function, `ignore(name, why)`
(engine/request.py): it logs the field once, and names it to the request's collector. This
middleware opens that collector around each HTTP request and, when the answer starts, adds

    X-Omnistage-Ignored: boundary_ratio, flow_shift

with the names in the order they were ignored (no header when nothing was). A streamed answer
carries what was known when its first byte left: the request's checks all run before it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnistage.engine.request import collect_ignored

HEADER = "X-Omnistage-Ignored"


def header_value(names: list[str]) -> str:
    """The header's value: the names, comma-separated (header-safe: latin-1 only)."""
    return ", ".join(names).encode("latin-1", "replace").decode("latin-1")


class IgnoredHeader:
    """Adds `X-Omnistage-Ignored` to every HTTP answer whose request had fields ignored."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        with collect_ignored() as names:
            async def tell(message: Message) -> None:
                if message["type"] == "http.response.start" and names:
                    headers = [*message.get("headers", ()),
                               (HEADER.lower().encode(), header_value(names).encode("latin-1"))]
                    message = {**message, "headers": headers}
                await send(message)

            await self.app(scope, receive, tell)
