"""The playground: one static page at `/` where a person uses the served model from a browser,
with no build step (static/: index.html, playground.js, playground.css, the Duplex tab's
duplex.js and the microphone's AudioWorklet, pcm_worklet.js). `omnistage serve
--no-playground` leaves it out. The stage-graph servers (api_server.py) and the full-duplex
one (duplex/app.py) serve the same page; each card's capabilities choose its tabs.

    GET /                   the page           no API key: it holds no data
    GET /playground/NAME    its script, style  no API key
    GET /v1/models          capabilities       the page's tabs follow them; needs the key

The page calls the same APIs as any client, with the key the person typed (kept in the
browser's localStorage) as `Authorization: Bearer KEY`; a browser's WebSocket cannot send
headers, so there the key travels as the `openai-insecure-api-key.KEY` subprotocol, as with
OpenAI's browser clients (api_server.APIKeyCheck takes both).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

from omnistage.entrypoints.openai.client import EngineClient
from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.protocol import ModelCapabilities

STATIC = Path(__file__).parent / "static"
ASSETS = {"playground.js": "text/javascript", "playground.css": "text/css",
          "pcm_worklet.js": "text/javascript", "duplex.js": "text/javascript"}
REALTIME_ROUTE = "/v1/realtime"
DUPLEX_ROUTE = "/v1/duplex"


def add_playground(app: FastAPI) -> None:
    """GET / and its assets, outside the OpenAPI schema (they are not API)."""

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/playground/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise APIError(404, f"/playground/{name}: no such file", code="not_found")
        return FileResponse(STATIC / name, media_type=ASSETS[name])


def capabilities(client: EngineClient, has_speech: bool, has_video: bool,
                 app: FastAPI) -> ModelCapabilities:
    """The generation routes that serve this model (each one refuses the others with a 400)
    and what a chat message may carry: the input processor's part types, else text. The
    realtime route counts where it is registered and the model takes and makes audio."""
    outputs = client.outputs
    inputs = client.processor.input_modalities if client.processor is not None else ("text",)
    has_text = "text" in outputs and not client.text_entry
    routes = {getattr(r, "path", None) for r in app.routes}
    served = {
        "/v1/chat/completions": "text" in outputs or "image" in outputs,
        "/v1/completions": has_text,
        "/v1/images/generations": "image" in outputs,
        "/v1/audio/speech": has_speech,
        "/v1/videos": has_video,
        REALTIME_ROUTE: REALTIME_ROUTE in routes and "audio" in inputs and "audio" in outputs,
    }
    return ModelCapabilities(endpoints=[path for path, ok in served.items() if ok],
                             input_modalities=list(inputs))


def duplex_capabilities() -> dict[str, object]:
    """A full-duplex model's card: it hears audio and is served on /v1/duplex alone (its
    /v1/realtime alias speaks the duplex protocol, not the turns the Realtime tab sends, so it
    is not listed). `duplex: true` says so to clients that read no route list."""
    caps = ModelCapabilities(endpoints=[DUPLEX_ROUTE], input_modalities=["audio"])
    return {**caps.model_dump(), "duplex": True}
