"""The playground on the full-duplex server (duplex/app.py) in process, with a stand-in runtime
(the page and the card need no model): the page and its Duplex tab's script served without the
key, the card in the other servers' shape saying /v1/duplex (the route the tab follows),
--no-playground; and no stage-graph model's card ever names /v1/duplex, so the tab stays hidden
there (test_playground_duplex.py drives the tab in a browser)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from omnistage.entrypoints.openai.duplex.app import build_duplex_app
from omnistage.entrypoints.openai.playground import DUPLEX_ROUTE, REALTIME_ROUTE, capabilities

MODEL = "moshi-tiny"


def duplex_client(**kw: object) -> TestClient:
    runtime = SimpleNamespace(is_alive=True)       # what /health reads; the page reads nothing
    return TestClient(build_duplex_app(runtime, MODEL, **kw))  # type: ignore[arg-type]


def test_the_duplex_server_serves_the_page_with_its_tab() -> None:
    client = duplex_client(api_key="k")
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'data-tab="duplex"' in page.text and 'id="panel-duplex"' in page.text
    # duplex.js before playground.js: playground.js starts the page, calling setupDuplex
    assert page.text.index("/playground/duplex.js") < page.text.index("/playground/playground.js")
    script = client.get("/playground/duplex.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    for needed in ("/v1/duplex", "input_audio_buffer.append", "session.close",
                   "response.output_audio.delta", "session.ended", "function setupDuplex"):
        assert needed in script.text, needed
    assert "setupDuplex()" in client.get("/playground/playground.js").text
    assert client.get("/v1/models").status_code == 401      # the APIs keep their key
    for path in ("/playground/nope.js", "/nope"):          # OpenAI's error JSON
        missing = client.get(path, headers={"Authorization": "Bearer k"})
        assert missing.status_code == 404 and missing.json()["error"]["message"], path


def test_the_card_says_duplex_in_the_shape_the_page_reads() -> None:
    card = duplex_client().get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["modalities"] == ["audio", "text"]
    # /v1/realtime (the duplex alias) is not listed: the Realtime tab's turns are not served
    assert card["capabilities"] == {"endpoints": [DUPLEX_ROUTE], "input_modalities": ["audio"],
                                    "duplex": True}


def test_no_playground() -> None:
    client = duplex_client(enable_playground=False)
    for path in ("/", "/playground/duplex.js"):
        off = client.get(path)
        assert off.status_code == 404 and off.json()["error"], path
    assert client.get("/health").json() == {"status": "ok"}


def test_no_stage_graph_model_offers_the_duplex_tab() -> None:
    """Whatever a stage-graph model hears and makes (realtime voice included), its card's
    routes, which the page's tabs follow, never include /v1/duplex."""
    app = FastAPI()
    app.add_api_websocket_route(REALTIME_ROUTE, lambda ws: None)
    kinds = ("text", "image", "audio")
    seen = set()
    for outputs, inputs, speech, video in itertools.product(
            [("text",), ("image",), ("text", "audio")], [("text",), kinds], (False, True),
            (False, True)):
        client = SimpleNamespace(outputs=outputs, text_entry=False,
                                 processor=SimpleNamespace(input_modalities=inputs))
        caps = capabilities(client, speech, video, app)  # type: ignore[arg-type]
        assert DUPLEX_ROUTE not in caps.endpoints, (outputs, inputs, caps)
        seen.update(caps.endpoints)
    assert REALTIME_ROUTE in seen and "/v1/chat/completions" in seen
