"""Server-sent events the way OpenAI sends them, and the response that ends its requests.

    data: {"id": ..., "object": "chat.completion.chunk", "choices": [...]}\\n\\n
    : progress 0.40\\n\\n          (a comment: clients skip it; it shows diffusion progress)
    data: [DONE]\\n\\n

`EventStream` (and `ClosingStream`, any streamed body: speech) runs its `on_close` callbacks
whatever happens to the stream: finished, failed, cancelled by a client disconnect (Starlette
cancels the body when the client goes), or never started at all. That is where requests still running get aborted in every stage.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from omnistage.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def sse_comment(text: str) -> str:
    return f": {text}\n\n"


def sse_error(err: APIError) -> str:
    """A failure after the 200 went out: OpenAI's clients raise on an `error` event."""
    return sse(err.body())


class ClosingStream(StreamingResponse):
    """A streamed body whose `on_close` callbacks run however it ends."""

    def __init__(self, body: AsyncIterator[str | bytes], on_close: list[Callable[[], None]],
                 media_type: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(body, media_type=media_type, headers=headers)
        self._body = body
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for close in self._on_close:   # synchronous: runs even inside a cancelled scope
                try:
                    close()
                except Exception:
                    logger.exception("closing a stream failed")
            aclose = getattr(self._body, "aclose", None)
            if aclose is not None:
                await aclose()   # if cancelled here, the callbacks above have run already


class EventStream(ClosingStream):
    def __init__(self, body: AsyncIterator[str], on_close: list[Callable[[], None]]) -> None:
        super().__init__(body, on_close, "text/event-stream",
                         {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
