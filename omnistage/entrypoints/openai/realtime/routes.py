"""The /v1/realtime route (registered whatever the model: one that cannot hear and speak
answers the handshake with an `error` event saying so, then closes)."""

from __future__ import annotations

from fastapi import FastAPI, WebSocket

from omnistage.entrypoints.openai.client import EngineClient
from omnistage.entrypoints.openai.realtime.connection import RealtimeConnection, RealtimeLimits


def add_realtime_routes(app: FastAPI, client: EngineClient, model_name: str,
                        limits: RealtimeLimits) -> None:
    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        await RealtimeConnection(ws, client, model_name, limits).run()
