"""The app in process with a stand-in engine: a graph whose finals are text (a thinker) and
audio (a code2wav stage), emitting a known waveform in chunks. This pins down the HTTP side of
speech without a speech model: message.audio when not streamed, delta.audio (transcript and
pcm16 pieces) when streamed, the voice reaching the AR stages, the default modalities,
reasoning_effort reaching the chat template; and the app's plumbing: /health
503 when the engine is dead, CORS, the body limit on a chunked upload, the OpenAPI schema; the
playground page at / (without the key, or off), /v1/models' capabilities, the key as a
WebSocket subprotocol."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch

from omnistage.configs.schema import GraphConfig, StageConfig, StageInput
from omnistage.engine.inputs import parse_prompt
from omnistage.entrypoints.openai.api_server import ServerConfig, build_app
from omnistage.outputs import OmniOutput, RequestEvent, RequestMetrics
from omnistage.testing.tiny_tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer
from omnistage.utils.audio import decode_audio
from omnistage.stages.info import StageInfo

RATE = 16000
CHUNKS = [0.5 * torch.sin(torch.arange(i * 800, (i + 1) * 800) * 2 * torch.pi * 440 / RATE)
          for i in range(4)]                                     # 4 chunks of (800,)
WAVE = torch.cat(CHUNKS).numpy()


class FakeOmni:
    """What the server uses of AsyncOmni, answering every request with "Hi there" and, when
    audio is asked for, the four chunks of a 440 Hz tone."""

    def __init__(self, tokenizer_dir: Path) -> None:
        self.graph = GraphConfig(stages=(
            StageConfig(name="thinker", kind="ar", final="text"),
            StageConfig(name="code2wav", kind="generation", component="vocoder", final="audio",
                        inputs=(StageInput(source="thinker", adapter="codes"),))))
        self.tokenizer = build_tiny_tokenizer(tokenizer_dir)
        self.entry, self.text_entry, self.is_healthy = ["thinker"], False, True
        self.audio_sample_rate = None     # the chunks carry their own rate
        self.speech = None                # no text-to-speech routes
        self.video = None                 # no video (/v1/videos answers 400)
        self.orchestrator = SimpleNamespace(stage_info={"thinker": StageInfo(max_model_len=64)},
                                            dead_reason=None, stage_stats=lambda timeout: {},
                                            degraded_reason=None, replica_status=lambda: {})
        self.params: list = []
        self.prompts: list = []

    def prepare(self, request):
        self.params.append(list(request.params))
        self.prompts.append(request.prompt)
        return (parse_prompt(request.prompt, self.tokenizer),
                dict(zip(["thinker", "code2wav"], request.params)))

    def add_request(self, request, sink, prepared) -> OmniOutput:
        parsed, _ = prepared
        request_id, modalities = request.request_id, request.modalities
        out = OmniOutput(request_id, parsed.text, list(parsed.token_ids or []),
                         metrics=RequestMetrics(arrival_time=time.time()))
        ids = self.tokenizer("Hi there")["input_ids"]

        def play() -> None:
            for i, t in enumerate(ids):
                sink(RequestEvent(request_id, "thinker", [t], self.tokenizer.decode([t]),
                                  stage_finished=i == len(ids) - 1,
                                  finish_reason="stop" if i == len(ids) - 1 else None))
            if "audio" in modalities:
                for i, chunk in enumerate(CHUNKS):
                    last = i == len(CHUNKS) - 1
                    sink(RequestEvent(request_id, "code2wav", tensors={
                        "audio": chunk, "sample_rate": torch.tensor([RATE])},
                        stage_finished=last, finish_reason="stop" if last else None))
            sink(RequestEvent(request_id, "code2wav", done=True, finish_reason="stop",
                              stage_metrics={}))

        threading.Thread(target=play, daemon=True).start()
        return out

    def abort(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> FakeOmni:
    return FakeOmni(tmp_path_factory.mktemp("tok"))


def call(engine: FakeOmni, method: str, path: str, config: ServerConfig | None = None,
         **kw: object) -> httpx.Response:
    async def go() -> httpx.Response:
        app = build_app(engine, config or ServerConfig(served_model_name="omni"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, timeout=30, **kw)

    return asyncio.run(go())


def post(engine: FakeOmni, body: dict) -> httpx.Response:
    return call(engine, "POST", "/v1/chat/completions", json=body)


AUDIO_CHAT = {"model": "omni", "messages": [{"role": "user", "content": "say hi"}],
              "modalities": ["text", "audio"]}


@pytest.mark.parametrize("fmt", ["wav", "flac", "pcm16"])
def test_audio_answer_not_streamed(engine: FakeOmni, fmt: str) -> None:
    r = post(engine, {**AUDIO_CHAT, "audio": {"voice": "ethan", "format": fmt}})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] is None and message["audio"]["transcript"] == "Hi there"
    wave, rate = decode_audio(base64.b64decode(message["audio"]["data"]), fmt, RATE)
    assert rate == RATE and wave.shape == (1, len(WAVE))
    np.testing.assert_allclose(wave[0], WAVE, atol=1 / 32767 + 1e-6)
    assert engine.params[-1][0].extra["speaker"] == "ethan"   # the talker hears the voice


def test_audio_answer_streamed_as_pcm16_chunks(engine: FakeOmni) -> None:
    """OpenAI's streamed speech: no delta.content; delta.audio carries the transcript pieces
    and the pcm16 pieces (the id on the first of each), and last only expires_at."""
    r = post(engine, {**AUDIO_CHAT, "audio": {"voice": "ethan", "format": "pcm16"},
                      "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant"}
    assert not any(d.get("content") for d in deltas)
    audio = [d["audio"] for d in deltas if "audio" in d]
    pieces = [a for a in audio if "transcript" in a]
    data = [a for a in audio if "data" in a]
    assert "".join(a["transcript"] for a in pieces) == "Hi there" and len(pieces) > 1
    assert len(data) == len(CHUNKS)
    audio_id = pieces[0]["id"]
    assert data[0]["id"] == audio_id
    assert all("id" not in a for a in pieces[1:] + data[1:])
    assert set(audio[-1]) == {"expires_at"} and audio[-1]["expires_at"] > time.time()
    pcm = b"".join(base64.b64decode(a["data"]) for a in data)
    wave, _ = decode_audio(pcm, "pcm16", RATE)
    np.testing.assert_allclose(wave[0], WAVE, atol=1 / 32767 + 1e-6)
    assert events[-1]["usage"]["completion_tokens"] == len(engine.tokenizer("Hi there")
                                                            ["input_ids"])
    assert r.text.rstrip().endswith("data: [DONE]")


def test_audio_requests_checked(engine: FakeOmni) -> None:
    cases = [({**AUDIO_CHAT, "audio": {"voice": "ethan", "format": "wav"}, "stream": True},
              "audio.format"),                                              # streams are pcm16
             ({**AUDIO_CHAT, "modalities": ["image"]}, "modalities"),
             ({**AUDIO_CHAT, "modalities": ["text"], "audio": {"voice": "ethan"}}, "audio")]
    for body, param in cases:
        r = post(engine, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    text_only = post(engine, {**AUDIO_CHAT, "modalities": ["text"]})
    message = text_only.json()["choices"][0]["message"]
    assert message["content"] == "Hi there" and message["audio"] is None


def test_default_modalities(engine: FakeOmni) -> None:
    """OpenAI's default (text) unless the server says otherwise; `audio` may be left out (the
    model's voice, wav)."""
    body = {"model": "omni", "messages": AUDIO_CHAT["messages"]}
    assert post(engine, body).json()["choices"][0]["message"]["audio"] is None
    config = ServerConfig(served_model_name="omni", default_modalities=("text", "audio"))
    r = call(engine, "POST", "/v1/chat/completions", config, json=body)
    message = r.json()["choices"][0]["message"]
    assert message["content"] is None and message["audio"]["transcript"] == "Hi there"
    wave, rate = decode_audio(base64.b64decode(message["audio"]["data"]), "wav")
    assert rate == RATE and wave.shape == (1, len(WAVE))
    assert "speaker" not in engine.params[-1][0].extra      # the talker's own voice
    with pytest.raises(ValueError, match="default_modalities"):
        build_app(engine, ServerConfig(default_modalities=("image",)))


THINKING_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}")


def test_reasoning_effort_reaches_the_templates_thinking_switch(engine: FakeOmni) -> None:
    config = ServerConfig(served_model_name="omni", chat_template=THINKING_TEMPLATE)
    body = {"model": "omni", "messages": AUDIO_CHAT["messages"]}

    def prompt(**fields: object) -> str:
        r = call(engine, "POST", "/v1/chat/completions", config, json={**body, **fields})
        assert r.status_code == 200, r.text
        return engine.tokenizer.decode(engine.prompts[-1]["prompt_token_ids"])

    assert prompt(reasoning_effort="none").endswith("</think>\n\n")
    assert "<think>" not in prompt(reasoning_effort="high") and "<think>" not in prompt()
    # chat_template_kwargs win over it
    assert "<think>" not in prompt(reasoning_effort="none",
                                   chat_template_kwargs={"enable_thinking": True})


def test_health_is_503_when_the_engine_is_dead(engine: FakeOmni) -> None:
    assert call(engine, "GET", "/health").status_code == 200
    engine.is_healthy, engine.orchestrator.dead_reason = False, "stage 'code2wav' was killed"
    try:
        r = call(engine, "GET", "/health")
        assert r.status_code == 503 and "code2wav" in r.json()["error"]["message"]
        r = post(engine, {**AUDIO_CHAT, "modalities": ["text"]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        engine.is_healthy, engine.orchestrator.dead_reason = True, None


def test_health_is_200_degraded_while_a_replica_is_down(engine: FakeOmni) -> None:
    assert call(engine, "GET", "/health").json()["status"] == "ok"
    orch = engine.orchestrator
    orch.degraded_reason = "stage 'code2wav' replica 1 killed by signal 9"
    orch.replica_status = lambda: {"code2wav": [{"replica": 0, "live": True, "outstanding": 2},
                                                {"replica": 1, "live": False, "outstanding": 0}]}
    try:
        r = call(engine, "GET", "/health")
        assert r.status_code == 200 and r.json()["status"] == "degraded"
        assert "replica 1" in r.json()["reason"]
        assert r.json()["replicas"]["code2wav"][1]["live"] is False
        text = call(engine, "GET", "/metrics").text
        assert 'omnistage_replica_up{replica="1",stage="code2wav"} 0.0' in text
        assert 'omnistage_replica_outstanding_requests{replica="0",stage="code2wav"} 2.0' in text
    finally:
        orch.degraded_reason, orch.replica_status = None, lambda: {}


def test_cors_is_off_by_default_and_configurable(engine: FakeOmni) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = call(engine, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    config = ServerConfig(served_model_name="omni", allowed_origins=("https://app.example",),
                          api_key="k")
    r = call(engine, "OPTIONS", "/v1/chat/completions", config, headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = call(engine, "GET", "/v1/models", config, headers={"Origin": "https://app.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"]
    r = call(engine, "OPTIONS", "/v1/models", config,
             headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_body_limit_holds_for_chunked_uploads(engine: FakeOmni) -> None:
    config = ServerConfig(served_model_name="omni", max_body_bytes=1000)

    async def chunks():
        for _ in range(20):
            yield b"x" * 100

    r = call(engine, "POST", "/v1/chat/completions", config, content=chunks(),
             headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    ok = call(engine, "POST", "/v1/chat/completions", config,
              json={**AUDIO_CHAT, "modalities": ["text"]})
    assert ok.status_code == 200


def test_openapi_schema_lists_every_route(engine: FakeOmni) -> None:
    schema = call(engine, "GET", "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/images/generations",
            "/v1/images/edits", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "400", "429"} <= set(chat["responses"])


def test_video_routes_refuse_a_model_without_video(engine: FakeOmni) -> None:
    for method, path in (("POST", "/v1/videos"), ("GET", "/v1/videos"),
                         ("GET", "/v1/videos/video_1/content"), ("DELETE", "/v1/videos/x")):
        kw = {"json": {"prompt": "a cat"}} if method == "POST" else {}
        r = call(engine, method, path, **kw)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_video", r.text
    assert "/v1/videos" in call(engine, "GET", "/openapi.json").json()["paths"]


def test_a_timed_out_request_is_a_504(engine: FakeOmni) -> None:
    """A stage whose input stalled past its input_timeout_s fails the request with kind
    "timeout": the gateway-timeout status, the engine still healthy."""
    from omnistage.entrypoints.openai.client import EngineClient
    from omnistage.errors import StageError

    message = "no input from thinker for 300 s"
    out = OmniOutput("r", None, [], finished=True,
                     error=StageError("talker", "timeout", message))
    out.outputs[0].finish_reason = "error"
    err = EngineClient(engine, 4).failure(out)
    assert (err.status, err.code) == (504, "engine_timeout") and "thinker" in err.message


def test_the_api_key_guards_every_route_but_health_and_the_page(engine: FakeOmni) -> None:
    """/metrics, /docs, /redoc and /openapi.json tell a stranger about the server: they need
    the key like /v1/*; /health and the playground page do not, /metrics neither with
    --open-metrics."""
    keyed = ServerConfig(served_model_name="omni", api_key="k")
    opened = ServerConfig(served_model_name="omni", api_key="k", open_metrics=True)
    key = {"Authorization": "Bearer k"}
    for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models", "/nowhere"):
        r = call(engine, "GET", path, keyed)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert call(engine, "GET", path, keyed, headers=key).status_code != 401, path
    for path in ("/health", "/", "/playground/playground.js"):
        assert call(engine, "GET", path, keyed).status_code == 200, path
    assert call(engine, "GET", "/metrics", opened).status_code == 200
    assert call(engine, "GET", "/docs", opened).status_code == 401


def test_the_served_name_hides_the_checkpoint_path(engine: FakeOmni) -> None:
    config = ServerConfig(model="/srv/secret/ckpt", served_model_name="omni")
    for path in ("/v1/models", "/v1/models/omni", "/v1/models/other"):
        r = call(engine, "GET", path, config)
        assert "/srv/secret" not in r.text + str(r.headers), (path, r.text)
    assert call(engine, "GET", "/v1/models", config).json()["data"][0]["root"] == "omni"
    unnamed = ServerConfig(model="/srv/ckpt")          # no served name: the path is the name
    assert call(engine, "GET", "/v1/models", unnamed).json()["data"][0]["root"] == "/srv/ckpt"


def test_an_engine_failure_shows_the_client_no_internals(engine: FakeOmni) -> None:
    """A stage's exception text may name files and processes: the 500 names the stage only."""
    from omnistage.entrypoints.openai.client import EngineClient
    from omnistage.errors import StageError

    message = "RuntimeError: cannot open /srv/models/x.safetensors (pid 4242)"
    out = OmniOutput("r", None, [], finished=True,
                     error=StageError("talker", "internal", message))
    out.outputs[0].finish_reason = "error"
    err = EngineClient(engine, 4).failure(out)
    assert (err.status, err.code) == (500, "engine_error") and "talker" in err.message
    assert "/srv" not in err.message and "4242" not in err.message
    assert "RuntimeError" not in err.message


def test_a_request_whose_stage_died_is_a_503_after_the_restart_too(engine: FakeOmni) -> None:
    """Kind "stage_dead" is the server's failure, not the request's: 503 (retry), even when a
    restart made the engine healthy before the error was turned into a response."""
    from omnistage.entrypoints.openai.client import EngineClient
    from omnistage.errors import StageError

    message = "stage 'talker' died (killed by signal 9)"
    out = OmniOutput("r", None, [], finished=True,
                     error=StageError("talker", "stage_dead", message))
    out.outputs[0].finish_reason = "error"
    assert engine.is_healthy
    err = EngineClient(engine, 4).failure(out)
    assert (err.status, err.code) == (503, "engine_dead") and "talker" in err.message


def test_the_speech_websocket_checks_the_api_key_and_the_model(engine: FakeOmni,
                                                               tmp_path: Path) -> None:
    """With an API key the handshake needs it (refused before accept); a model without speech
    answers the session with an error event and closes."""
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    app = build_app(engine, ServerConfig(served_model_name="omni", api_key="k",
                                         voices_dir=str(tmp_path)))
    with TestClient(app) as client:
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect("/v1/audio/speech/stream"):
                pass
        assert refused.value.code == 1008
        with client.websocket_connect("/v1/audio/speech/stream",
                                      headers={"Authorization": "Bearer k"}) as ws:
            assert ws.receive_json()["error"]["code"] == "model_not_speech"


def test_the_playground_is_served_without_the_key_and_can_be_turned_off(engine: FakeOmni
                                                                        ) -> None:
    """The page and its assets need no key (they hold no data); the APIs keep theirs;
    --no-playground (enable_playground=False) leaves / a 404."""
    keyed = ServerConfig(served_model_name="omni", api_key="k")
    page = call(engine, "GET", "/", keyed)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/playground/playground.js">' in page.text
    for name, kind in (("playground.js", "javascript"), ("playground.css", "css"),
                       ("pcm_worklet.js", "javascript")):
        r = call(engine, "GET", f"/playground/{name}", keyed)
        assert r.status_code == 200 and kind in r.headers["content-type"] and r.text
    assert call(engine, "GET", "/playground/..%2Fplayground.py", keyed).status_code == 404
    assert call(engine, "GET", "/v1/models", keyed).status_code == 401
    off = ServerConfig(served_model_name="omni", enable_playground=False)
    for path in ("/", "/playground/playground.js"):
        r = call(engine, "GET", path, off)
        assert r.status_code == 404 and r.json()["error"], r.text
    assert "/" not in call(engine, "GET", "/openapi.json").json()["paths"]


def models_card(app) -> dict:
    async def go() -> dict:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get("/v1/models")).json()["data"][0]

    return asyncio.run(go())


def test_models_say_what_the_model_can_do(engine: FakeOmni) -> None:
    """The routes that serve the model and what a chat may carry (the playground's tabs):
    text in, text and audio out here; /v1/realtime only for a model that also hears."""
    card = models_card(build_app(engine, ServerConfig(served_model_name="omni")))
    assert card["modalities"] == ["audio", "text"]
    assert card["capabilities"] == {"endpoints": ["/v1/chat/completions", "/v1/completions"],
                                    "input_modalities": ["text"]}
    hearing = copy.copy(engine)
    hearing.processor = SimpleNamespace(input_modalities=("text", "audio"))
    caps = models_card(build_app(hearing, ServerConfig(served_model_name="omni")))[
        "capabilities"]
    assert caps["endpoints"][-1] == "/v1/realtime" and caps["input_modalities"] == ["text",
                                                                                    "audio"]


def test_a_browser_sends_the_key_as_a_websocket_subprotocol(engine: FakeOmni,
                                                            tmp_path: Path) -> None:
    """A browser's WebSocket cannot send headers: the key comes as the subprotocol
    `openai-insecure-api-key.KEY` beside `realtime`, and the handshake answers `realtime` (a
    browser drops one that answers none it offered), never the key, with or without a key
    set on the server."""
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    offered = ["realtime", "openai-insecure-api-key.k"]
    for api_key in ("k", None):
        app = build_app(engine, ServerConfig(served_model_name="omni", api_key=api_key,
                                             voices_dir=str(tmp_path)))
        with TestClient(app) as client:
            with client.websocket_connect("/v1/audio/speech/stream", subprotocols=offered) as ws:
                assert ws.accepted_subprotocol == "realtime"
                assert ws.receive_json()["error"]["code"] == "model_not_speech"
    app = build_app(engine, ServerConfig(served_model_name="omni", api_key="k",
                                         voices_dir=str(tmp_path)))
    with TestClient(app) as client:
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect("/v1/audio/speech/stream",
                                          subprotocols=["realtime", "openai-insecure-api-key.x"]):
                pass
        assert refused.value.code == 1008
