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
import time
from typing import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.protocol import DeltaAudio

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


class SpeechDeltas:
    """The `delta.audio` pieces of one streamed spoken answer, in OpenAI's order:

        {"id": ID, "transcript": "Hi"}   {"transcript": " there"}   ...   (the text)
        {"id": ID, "data": B64}          {"data": B64}              ...   (pcm16 chunks)
        {"expires_at": T}                                                 (last)

    Transcript and audio pieces interleave as the stages make them."""

    def __init__(self, audio_id: str, ttl_s: int) -> None:
        self.audio_id = audio_id
        self.ttl_s = ttl_s
        self._named: set[str] = set()        # the kinds of piece that carried the id already

    def _id(self, kind: str) -> str | None:
        if kind in self._named:
            return None
        self._named.add(kind)
        return self.audio_id

    def transcript(self, text: str) -> DeltaAudio:
        return DeltaAudio(id=self._id("transcript"), transcript=text)

    def data(self, b64: str) -> DeltaAudio:
        return DeltaAudio(id=self._id("data"), data=b64)

    def end(self) -> DeltaAudio:
        return DeltaAudio(expires_at=int(time.time()) + self.ttl_s)
