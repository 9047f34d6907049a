"""The clients of `omnistage bench realtime` (realtime.py, realtime_turns.py): a WebSocket
session on /v1/realtime that sends events and reads them with the time each arrived."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import numpy as np

from omnistage.testing.speech_like import pcm16

TURN_TIMEOUT_S = 300     # the longest wait for one event
RATE = 24000             # the input rate of a session that declares none (OpenAI's PCM16)


class Session:
    """One client: a WebSocket and the events it reads."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    async def send(self, kind: str, **fields: Any) -> None:
        await self.ws.send(json.dumps({"type": kind, **fields}))

    async def next(self) -> tuple[dict[str, Any], float]:
        """The next event and when it arrived (errors raise)."""
        ev = json.loads(await asyncio.wait_for(self.ws.recv(), TURN_TIMEOUT_S))
        if ev["type"] == "error":
            raise RuntimeError(f"realtime error: {ev['error']}")
        return ev, time.perf_counter()

    async def until(self, kind: str) -> tuple[dict[str, Any], float]:
        """The first event of `kind` and when it arrived (errors raise)."""
        while True:
            ev, arrived = await self.next()
            if ev["type"] == kind:
                return ev, arrived

    async def speak(self, audio: np.ndarray, chunk_s: float = 0.1,
                    real_time: bool = False) -> None:
        step = int(RATE * chunk_s)
        for i in range(0, len(audio), step):
            data = base64.b64encode(pcm16(audio[i:i + step])).decode("ascii")
            await self.send("input_audio_buffer.append", audio=data)
            if real_time:
                await asyncio.sleep(chunk_s)


async def open_session(url: str, model: str, session: dict[str, Any]) -> Session:
    from websockets.asyncio.client import connect

    ws = await connect(f"{url}/v1/realtime?model={model}".replace("http", "ws", 1),
                       max_size=None, open_timeout=60)
    s = Session(ws)
    await s.until("session.created")
    await s.send("session.update", session=session)
    await s.until("session.updated")
    return s
