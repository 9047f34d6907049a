"""The playground's realtime-voice tab in headless Chromium (its fake microphone, a beep) against
a scripted /v1/realtime: the real page and the real API-key middleware, with a stand-in for the
endpoint that answers each turn with a fixed transcript and 0.1 s of audio. It pins down the
page's side of the OpenAI Realtime protocol: the key as a subprotocol (the handshake answered
`realtime`), session.update with its 16 kHz input declared (a session that declares no rate
is taken as OpenAI's 24 kHz) and the turn detection chosen, push to talk as
append... / commit / response.create with the microphone resampled to 16 kHz, the answer shown
and timed, server VAD streaming without a button and barge-in cancelling the answer."""

from __future__ import annotations

import base64
import threading
import time
from typing import TYPE_CHECKING, Iterator

import pytest
from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from omnistage.entrypoints.openai.api_server import APIKeyCheck
from omnistage.entrypoints.openai.playground import add_playground
from omnistage.testing.browser import open_playground, visible_tabs, wait_for
from omnistage.testing.processes import free_port

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

KEY = "rt-key"
IN_RATE = 16000
ANSWER = "hello there"
ANSWER_AUDIO = base64.b64encode(bytes(2 * 2400)).decode()        # 0.1 s of 24 kHz silence


class ScriptedRealtime:
    """What the page sent (every event but the audio, whose samples are counted), and the
    scripted answers."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.num_samples = 0
        self.num_vad_samples = 0        # heard with VAD on: 0.2 s in it answers, 0.4 s in the
        self.protocols: list[str] = []  # person "speaks" over the answer

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    async def serve(self, ws: WebSocket) -> None:
        self.protocols = list(ws.scope.get("subprotocols", []))
        await ws.accept()
        await ws.send_json({"type": "session.created", "session": {}})
        try:
            while True:
                await self.handle(ws, await ws.receive_json())
        except WebSocketDisconnect:
            pass

    async def handle(self, ws: WebSocket, event: dict) -> None:
        if event["type"] == "input_audio_buffer.append":
            n = len(base64.b64decode(event["audio"])) // 2
            self.num_samples += n
            if self.vad_on():
                await self.vad_script(ws, self.num_vad_samples, self.num_vad_samples + n)
                self.num_vad_samples += n
            return
        self.events.append(event)
        if event["type"] == "session.update":
            await ws.send_json({"type": "session.updated", "session": event["session"]})
        elif event["type"] == "response.create":
            for answer in ({"type": "response.created", "response": {"id": "resp_1"}},
                           {"type": "response.output_audio_transcript.delta", "delta": ANSWER},
                           {"type": "response.output_audio.delta", "delta": ANSWER_AUDIO}):
                await ws.send_json(answer)
            await ws.send_json({"type": "response.done", "response": {
                "id": "resp_1", "usage": {"output_tokens": 3}}})
        elif event["type"] == "input_audio_buffer.commit":
            await ws.send_json({"type": "input_audio_buffer.committed", "item_id": "item_1"})

    async def vad_script(self, ws: WebSocket, before: int, after: int) -> None:
        """An answer that stays open after 0.2 s of audio, speech over it after 0.4 s."""
        if before < IN_RATE // 5 <= after:
            await ws.send_json({"type": "response.created", "response": {"id": "resp_2"}})
            await ws.send_json({"type": "response.output_audio.delta", "delta": ANSWER_AUDIO})
        if before < 2 * IN_RATE // 5 <= after:
            await ws.send_json({"type": "input_audio_buffer.speech_started",
                                "audio_start_ms": 400, "item_id": "item_2"})

    def vad_on(self) -> bool:
        updates = [e for e in self.events if e["type"] == "session.update"]
        return bool(updates and updates[-1]["session"]["audio"]["input"]["turn_detection"])


@pytest.fixture(scope="module")
def realtime() -> Iterator[tuple[str, ScriptedRealtime]]:
    """The page and the scripted endpoint behind the API key, on uvicorn in a thread."""
    import uvicorn

    script = ScriptedRealtime()
    app = FastAPI()
    add_playground(app)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": "fake-omni", "object": "model", "modalities": ["audio", "text"],
            "capabilities": {"endpoints": ["/v1/realtime"],
                             "input_modalities": ["text", "audio"]}}]}

    app.add_api_websocket_route("/v1/realtime", script.serve)
    app.add_middleware(APIKeyCheck, api_key=KEY)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", ws="websockets"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", script
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


def test_push_to_talk_then_voice_detection(browser: WebDriver,
                                           realtime: tuple[str, ScriptedRealtime]) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    url, script = realtime
    open_playground(browser, url)
    browser.find_element(By.ID, "api-key").send_keys(KEY, Keys.ENTER)
    wait_for(browser, "the model loaded", lambda d: d.execute_script(
        "return document.body.dataset.ready === 'true'"))
    assert visible_tabs(browser) == ["Realtime voice"]
    browser.find_element(By.ID, "rt-connect").click()
    talk = browser.find_element(By.ID, "rt-talk")
    wait_for(browser, "connected", lambda d: talk.is_enabled())
    assert script.protocols == ["realtime"]                 # the key taken out by APIKeyCheck
    session = script.events[0]["session"]
    assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": IN_RATE}
    assert session["audio"]["input"]["turn_detection"] is None

    # push to talk, by keyboard: Space held on the focused button for about 0.8 s
    assert script.num_samples == 0                          # nothing sent before the button
    browser.execute_script("arguments[0].focus()", talk)
    held_from = time.monotonic()
    ActionChains(browser).key_down(Keys.SPACE).pause(0.8).key_up(Keys.SPACE).perform()
    held_s = time.monotonic() - held_from
    wait_for(browser, "the answer", lambda d: ANSWER in d.find_element(By.ID, "rt-log").text)
    assert script.types()[1:] == ["input_audio_buffer.clear", "input_audio_buffer.commit",
                                  "response.create"]
    # the microphone (48 kHz here) reaches the server as 16 kHz: samples ~ seconds held
    assert 0.4 * IN_RATE * held_s < script.num_samples < 1.3 * IN_RATE * held_s, (
        script.num_samples, held_s)
    metrics = wait_for(browser, "the turn's metrics", lambda d: d.find_element(
        By.ID, "rt-metrics").text)
    assert "first audio" in metrics and "first token" in metrics, metrics

    # server VAD: a new session.update, audio streamed with no button, barge-in cancels
    browser.find_element(By.CSS_SELECTOR, 'input[name="rt-mode"][value="vad"]').click()
    wait_for(browser, "VAD on", lambda d: script.vad_on())
    assert not talk.is_enabled()
    vad = script.events[-1]["session"]["audio"]["input"]["turn_detection"]
    assert vad["type"] == "server_vad" and vad["silence_duration_ms"] == 500
    assert script.events[-1]["session"]["audio"]["input"]["format"]["rate"] == IN_RATE
    wait_for(browser, "the answer cancelled by speech over it",
             lambda d: "response.cancel" in script.types())
    assert script.num_vad_samples >= 2 * IN_RATE // 5
    browser.find_element(By.ID, "rt-connect").click()       # Disconnect
    wait_for(browser, "disconnected", lambda d: d.find_element(By.ID, "rt-connect").text
             == "Connect")
