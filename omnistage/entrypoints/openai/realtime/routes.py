"""The /v1/realtime route (registered whatever the model: one that cannot speak answers the
handshake with an `error` event saying so, then closes). `?resume=1` takes a dropped session
back (resume.py); the server's sessions live in one `Sessions`."""

from __future__ import annotations

from fastapi import FastAPI, WebSocket

from omnistage.entrypoints.openai.client import EngineClient
from omnistage.entrypoints.openai.realtime.connection import RealtimeConnection, RealtimeLimits
from omnistage.entrypoints.openai.realtime.resume import Sessions, is_resume, resume


def add_realtime_routes(app: FastAPI, client: EngineClient, model_name: str,
                        limits: RealtimeLimits) -> None:
    sessions = Sessions()

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        if is_resume(ws):
            await resume(ws, sessions)
        else:
            await RealtimeConnection(ws, client, model_name, limits, sessions).run()
