"""Text to speech through a real server serving the toy TTS model (omnistage/testing/toy_tts.py:
each character a 10 ms tone whose pitch is the voice's), with the official `openai` client as
OpenAI's docs call it: every format, streamed and whole, sse events, the batch route, voices
uploaded, listed, used, kept across a restart and deleted; the WebSocket speaking text that
arrives word by word before it is done, in order, and aborting on cancel and close; a 4xx with
OpenAI's error JSON for every bad request."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import httpx
import numpy as np
import openai
import pytest

from omnistage.entrypoints.openai.speech_stream import (MAX_APPEND_CHARS,
                                                       MAX_CLAUSES_IN_FLIGHT,
                                                       MAX_PENDING_CHARS)
from omnistage.testing.toy_tts import (MAX_INPUT_CHARS, RATE, SAMPLES_PER_CHAR, expected_wave,
                                       voice_pitch)
from omnistage.utils.audio import decode_audio, encode_audio

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "toy-tts"
TEXT = "Hello there, how are you?"
LSB = 1 / 32767 + 1e-6                 # 16-bit rounding
STEP_DELAY_S = 0.02                     # the toy speaker's step: 4 characters


@pytest.fixture(scope="module")
def tts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from omnistage.testing.toy_tts import build_toy_tts

    return build_toy_tts(tmp_path_factory.mktemp("toy_tts"), step_delay_s=STEP_DELAY_S)


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("voices")


def serve_args(tts: tuple[Path, Path], voices_dir: Path) -> list[str]:
    return [str(tts[0]), "--stage-config", str(tts[1]), "--served-model-name", MODEL,
            "--voices-dir", str(voices_dir), "--max-body-bytes", str(16 << 20)]


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tts: tuple[Path, Path],
           voices_dir: Path) -> Server:
    return start_server(serve_args(tts, voices_dir))


def tone_wav(seconds: float = 1.0, amp: float = 0.3, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return encode_audio((amp * np.sin(2 * np.pi * 330 * t)).astype(np.float32), rate, "wav")


def clone_pitch(wav: bytes) -> int:
    """The pitch the toy gives a voice cloned from `wav` (as the server hands the clip on)."""
    wave, _ = decode_audio(wav)
    return voice_pitch({"ref_audio": {"samples": wave.mean(axis=0).astype("<f4").tobytes()}})


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---- /v1/audio/speech ------------------------------------------------------------------------

def test_openai_client_create_and_streaming_response(server: Server) -> None:
    client = server.openai()
    whole = client.audio.speech.create(model=MODEL, voice="bass", input=TEXT,
                                       response_format="wav")
    wave, rate = decode_audio(whole.content, "wav")
    assert rate == RATE
    np.testing.assert_allclose(wave[0], expected_wave(TEXT, pitch=1), atol=LSB)
    with client.audio.speech.with_streaming_response.create(
            model=MODEL, voice="alto", input=TEXT, response_format="pcm") as resp:
        pieces = [p for p in resp.iter_bytes() if p]
    streamed, _ = decode_audio(b"".join(pieces), "pcm16", RATE)
    np.testing.assert_allclose(streamed[0], expected_wave(TEXT, pitch=0), atol=LSB)


def test_the_playground_speaks_with_the_chosen_voice(server: Server, browser: object) -> None:
    """The speech tab in headless Chromium: the voices come from /v1/audio/voices, and the
    page plays the wav of the voice chosen, as long as the text says."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from omnistage.testing.browser import open_playground, visible_tabs, wait_for

    open_playground(browser, server.url)
    assert visible_tabs(browser) == ["Speech"]
    voice = Select(browser.find_element(By.ID, "speech-voice"))
    wait_for(browser, "the voices listed", lambda d: len(voice.options) >= 2)
    assert [o.get_attribute("value") for o in voice.options][:2] == ["alto", "bass"]
    voice.select_by_value("bass")
    text = browser.find_element(By.ID, "speech-input")
    text.clear()
    text.send_keys(TEXT)
    browser.find_element(By.ID, "speech-go").click()
    duration = wait_for(browser, "the speech loaded", lambda d: d.execute_script(
        "const a = document.getElementById('speech-audio');"
        "return !a.hidden && a.readyState >= 1 && a.duration"))
    assert duration == pytest.approx(len(TEXT) * SAMPLES_PER_CHAR / RATE, abs=1e-3)
    assert "first audio" in browser.find_element(By.ID, "speech-metrics").text
    played = browser.execute_async_script(
        "const done = arguments[0];"
        "fetch(document.getElementById('speech-audio').src).then(r => r.arrayBuffer())"
        ".then(b => { let s = ''; new Uint8Array(b).forEach(x => s += String.fromCharCode(x));"
        "             done(btoa(s)); });")
    bass = server.post("/v1/audio/speech", json={"input": TEXT, "voice": "bass",
                                                 "response_format": "wav"})
    assert base64.b64decode(played) == bass.content       # the voice chosen, the file whole


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_decodes_to_the_length_spoken(server: Server, fmt: str) -> None:
    r = server.post("/v1/audio/speech", json={"model": MODEL, "input": TEXT, "voice": "alto",
                                              "response_format": fmt})
    assert r.status_code == 200, r.text
    wave, rate = decode_audio(r.content, "pcm16" if fmt == "pcm" else None, RATE)
    seconds = len(TEXT) * SAMPLES_PER_CHAR / RATE
    if fmt in ("flac", "wav", "pcm"):
        np.testing.assert_allclose(wave[0], expected_wave(TEXT, pitch=0), atol=LSB)
    else:                     # lossy codecs pad a frame or two (opus decodes at 48 kHz)
        assert seconds <= wave.shape[1] / rate <= seconds + 0.1


def test_voice_and_instructions_change_the_speech(server: Server) -> None:
    def speak(**kw: object) -> np.ndarray:
        r = server.post("/v1/audio/speech", json={"input": TEXT, "response_format": "wav",
                                                  **kw})
        assert r.status_code == 200, r.text
        return decode_audio(r.content)[0][0]

    np.testing.assert_allclose(speak(), expected_wave(TEXT, pitch=0), atol=LSB)  # first preset
    np.testing.assert_allclose(speak(voice="Bass", instructions="calmly"),
                               expected_wave(TEXT, pitch=1, instructions=True), atol=LSB)
    clip = tone_wav()
    for ref in (base64.b64encode(clip).decode(),
                "data:audio/wav;base64," + base64.b64encode(clip).decode()):
        np.testing.assert_allclose(speak(ref_audio=ref, ref_text="a tone", language="English"),
                                   expected_wave(TEXT, pitch=clone_pitch(clip)), atol=LSB)


def test_sse_events_carry_the_file(server: Server) -> None:
    body = {"input": TEXT, "voice": "bass", "response_format": "wav", "stream_format": "sse"}
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 2 and events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["input_tokens"] > 0
    wave, _ = decode_audio(b"".join(base64.b64decode(e["audio"]) for e in deltas))
    np.testing.assert_allclose(wave[0], expected_wave(TEXT, pitch=1), atol=LSB)


def test_batch_answers_each_item_in_its_place(server: Server) -> None:
    r = server.post("/v1/audio/speech/batch", json={
        "model": MODEL, "voice": "bass", "response_format": "flac",
        "items": [{"input": "One."}, {"input": "Two", "voice": "nobody"},
                  {"input": "Three", "voice": "alto"}, {"input": " "}]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1, 2, 3]
    for d, text, pitch in ((data[0], "One.", 1), (data[2], "Three", 0)):
        wave, rate = decode_audio(base64.b64decode(d["audio"]))
        assert d["format"] == "flac" and d["sample_rate"] == rate == RATE
        np.testing.assert_allclose(wave[0], expected_wave(text, pitch), atol=LSB)
    assert data[1]["error"]["param"] == "items[1].voice"
    assert data[1]["error"]["code"] == "voice_not_found"
    assert data[3]["error"]["param"] == "items[3].input"


# ---- voices ----------------------------------------------------------------------------------

def upload(server: Server, name: str, audio: bytes | None = None, consent: str = "true",
           **fields: str) -> httpx.Response:
    files = {"audio": ("clip.wav", audio if audio is not None else tone_wav(), "audio/wav")}
    return server.post("/v1/audio/voices", data={"name": name, "consent": consent, **fields},
                       files=files)


def names(server: Server) -> dict[str, str]:
    r = server.get("/v1/audio/voices")
    assert r.status_code == 200, r.text
    return {v["name"]: v["type"] for v in r.json()["data"]}


def test_voices_upload_use_survive_a_restart_and_delete(
        server: Server, start_server: Callable[..., Server], tts: tuple[Path, Path],
        voices_dir: Path) -> None:
    clip = tone_wav(amp=0.6)
    r = upload(server, "my_voice-1", clip, transcript="a tone")
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "my_voice-1" and r.json()["duration_s"] == 1.0
    assert names(server) == {"alto": "preset", "bass": "preset", "my_voice-1": "uploaded"}
    error_of(upload(server, "my_voice-1", clip), 409)
    speech = server.post("/v1/audio/speech", json={"input": TEXT, "voice": "my_voice-1",
                                                   "response_format": "wav"})
    np.testing.assert_allclose(decode_audio(speech.content)[0][0],
                               expected_wave(TEXT, clone_pitch(clip)), atol=LSB)
    restarted = start_server(serve_args(tts, voices_dir))
    assert names(restarted)["my_voice-1"] == "uploaded"
    assert restarted.get("/v1/audio/voices").json()["data"][-1]["transcript"] == "a tone"
    deleted = httpx.delete(f"{restarted.url}/v1/audio/voices/my_voice-1", timeout=30)
    assert deleted.status_code == 200, deleted.text
    assert "my_voice-1" not in names(server) and not list(voices_dir.iterdir())
    error_of(httpx.delete(f"{server.url}/v1/audio/voices/my_voice-1", timeout=30), 404)


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", "x" * 65, "", "sp ace", "dot.wav"])
def test_voice_names_cannot_escape_the_folder(server: Server, voices_dir: Path,
                                              name: str) -> None:
    assert error_of(upload(server, name), 400)["param"] == "name"
    assert not (voices_dir.parent / "escape.json").exists()


def test_presets_cannot_be_overwritten_or_deleted(server: Server) -> None:
    assert error_of(upload(server, "ALTO"), 400)["code"] == "voice_is_preset"
    r = httpx.delete(f"{server.url}/v1/audio/voices/bass", timeout=30)
    assert error_of(r, 400)["code"] == "voice_is_preset"
    r = httpx.delete(f"{server.url}/v1/audio/voices/..%2F..%2Fetc", timeout=30)
    assert r.status_code in (400, 404)


# ---- every bad request: a 4xx with OpenAI's error JSON ---------------------------------------

@pytest.mark.parametrize("body, status, param, code", [
    ({"voice": "nobody"}, 400, "voice", "voice_not_found"),
    ({"input": "   "}, 400, "input", "empty_input"),
    ({"input": "a" * (MAX_INPUT_CHARS + 1)}, 400, "input", "input_too_long"),
    ({"voice": None, "ref_audio": base64.b64encode(b"not audio at all").decode()}, 400,
     "ref_audio", "invalid_audio"),
    ({"voice": None, "ref_audio": "%%%"}, 400, "ref_audio", "invalid_base64"),
    ({"response_format": "ogg"}, 400, "response_format", None),
    ({"speed": 1.5}, 400, "speed", "unsupported_speed"),
    ({"language": "klingon"}, 400, "language", "unsupported_language"),
    ({"ref_text": "hi"}, 400, "ref_text", None),
    ({"model": "gpt-4o-mini-tts"}, 404, "model", "model_not_found"),
])
def test_bad_speech_requests(server: Server, body: dict, status: int, param: str,
                             code: str | None) -> None:
    r = server.post("/v1/audio/speech", json={"input": TEXT, "voice": "alto", **body})
    err = error_of(r, status)
    assert err["param"] == param and (code is None or err["code"] == code)


def test_bad_uploads(server: Server) -> None:
    assert error_of(upload(server, "v1", consent="false"), 400)["code"] == "consent_required"
    assert error_of(upload(server, "v2", b"garbage" * 100), 400)["code"] == "invalid_audio"
    assert error_of(upload(server, "v3", tone_wav(seconds=0.1)), 400)["param"] == "audio"
    big = b"\0" * ((10 << 20) + 1)
    assert error_of(upload(server, "v4", big), 413)["param"] == "audio"
    r = server.post("/v1/audio/voices", data={"name": "v5", "consent": "true"})
    assert error_of(r, 400)["param"] == "audio"


def test_models_offer_speech(server: Server) -> None:
    caps = server.get("/v1/models").json()["data"][0]["capabilities"]
    assert caps["endpoints"] == ["/v1/audio/speech"], caps


def test_a_model_without_speech_says_so(image_server: Server) -> None:
    r = image_server.post("/v1/audio/speech", json={"input": TEXT, "voice": "alto"})
    assert error_of(r, 400)["code"] == "model_not_speech"
    assert error_of(image_server.get("/v1/audio/voices"), 400)["code"] == "model_not_speech"
    with pytest.raises(openai.BadRequestError):
        image_server.openai().audio.speech.create(model="omnistage-demo", voice="alto",
                                                  input=TEXT)
    with connect(image_server) as ws:
        assert events_until(ws, "error")[-1]["error"]["code"] == "model_not_speech"


# ---- WebSocket /v1/audio/speech/stream -------------------------------------------------------

WORDS = "Hello there, this is a test. It speaks while I type, one word at a time".split()
LONG = " ".join(["This sentence is long enough to take a while to speak."] * 6) + " "


def events_until(ws, last: str, deadline_s: float = 30.0) -> list[dict]:
    """Events up to and including the first of type `last`."""
    out: list[dict] = []
    deadline = time.monotonic() + deadline_s
    while not out or out[-1]["type"] != last:
        out.append(json.loads(ws.recv(timeout=max(0.01, deadline - time.monotonic()))))
    return out


def ready_events(ws) -> list[dict]:
    """What has arrived by now, without waiting."""
    out = []
    while True:
        try:
            out.append(json.loads(ws.recv(timeout=0)))
        except TimeoutError:
            return out


def connect(server: Server):
    from websockets.sync.client import connect as ws_connect

    return ws_connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", open_timeout=30)


def test_websocket_speaks_while_the_text_arrives(server: Server) -> None:
    """Words one by one: audio of the first clause comes before input.done, the clauses come
    in text order, and their audio joined is each clause spoken in turn."""
    with connect(server) as ws:
        ws.send(json.dumps({"type": "session.update",
                            "session": {"voice": "bass", "response_format": "pcm"}}))
        assert events_until(ws, "session.updated")[-1]["sample_rate"] == RATE
        seen: list[dict] = []
        for word in WORDS:
            ws.send(json.dumps({"type": "input.append", "text": word + " "}))
            time.sleep(0.03)
            seen += ready_events(ws)
        if not any(e["type"] == "audio.delta" for e in seen):     # a slow machine: wait
            seen += events_until(ws, "audio.delta")
        ws.send(json.dumps({"type": "input.done"}))
        seen += events_until(ws, "audio.done")
    assert not [e for e in seen if e["type"] == "error"]
    clauses = [e["text"] for e in seen if e["type"] == "clause.done"]
    assert clauses == ["Hello there,", "this is a test.", "It speaks while I type,",
                       "one word at a time"]
    order = [e["clause"] for e in seen if e["type"] == "audio.delta"]
    assert order == sorted(order) and seen[-1]["clauses"] == 4
    pcm = b"".join(base64.b64decode(e["audio"]) for e in seen if e["type"] == "audio.delta")
    want = np.concatenate([expected_wave(c, pitch=1) for c in clauses])
    np.testing.assert_allclose(decode_audio(pcm, "pcm16", RATE)[0][0], want, atol=LSB)


def engine_idle_after_aborts(server: Server, aborted_before: float) -> float:
    """Wait until no stage holds a request and more requests ended as aborted."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = server.metrics()
        aborted = m.get(("omnistage_requests_finished_total", (("finish_reason", "abort"),)), 0)
        running = sum(m.get(("omnistage_stage_engine_requests", (("stage", stage),)), 0)
                      for stage in ("speaker", "vocoder"))
        if aborted > aborted_before and running == 0:
            return aborted
        time.sleep(0.1)
    raise AssertionError(f"requests still in the engine: {running}, aborted {aborted}")


def test_websocket_cancel_and_close_abort_in_the_engine(server: Server) -> None:
    before = server.metrics().get(
        ("omnistage_requests_finished_total", (("finish_reason", "abort"),)), 0)
    with connect(server) as ws:
        ws.send(json.dumps({"type": "session.update", "session": {"response_format": "wav"}}))
        ws.send(json.dumps({"type": "input.append", "text": LONG}))
        events_until(ws, "audio.delta")
        ws.send(json.dumps({"type": "cancel"}))
        events_until(ws, "cancelled")
        before = engine_idle_after_aborts(server, before)
        ws.send(json.dumps({"type": "input.append", "text": "Still here."}))  # goes on
        ws.send(json.dumps({"type": "input.done"}))
        done = events_until(ws, "audio.done")
        assert [e["text"] for e in done if e["type"] == "clause.done"] == ["Still here."]
        wav = b"".join(base64.b64decode(e["audio"]) for e in done if e["type"] == "audio.delta")
        np.testing.assert_allclose(decode_audio(wav)[0][0],          # a new file of its own
                                   expected_wave("Still here.", pitch=0), atol=LSB)
    with connect(server) as ws:
        ws.send(json.dumps({"type": "input.append", "text": LONG}))
        events_until(ws, "audio.delta")
    engine_idle_after_aborts(server, before)


def test_websocket_bad_messages_get_error_events(server: Server) -> None:
    with connect(server) as ws:
        for msg, param in ((["not", "an", "object"], None), ({"type": "speak"}, "type"),
                           ({"type": "input.append"}, "text"),
                           ({"type": "session.update", "session": {"voice": "nobody"}},
                            "session.voice"),
                           ({"type": "session.update", "session": {"response_format": "ogg"}},
                            "session.response_format")):
            ws.send(json.dumps(msg))
            err = events_until(ws, "error")[-1]["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error"
        ws.send(b"binary")
        assert events_until(ws, "error")[-1]["error"]["code"] == "invalid_json"
        ws.send(json.dumps({"type": "input.append", "text": "Fine. "}))
        ws.send(json.dumps({"type": "input.done"}))
        assert events_until(ws, "audio.done")[-1]["clauses"] == 1


def test_websocket_huge_appends_are_refused_and_the_server_answers(server: Server) -> None:
    """3 MB without a space in one append: refused with an error event naming the limit; a run
    of dots as long as one append may be is cut while /health answers (the old cutter, on the
    event loop, took hours on the first and minutes on the second); the session goes on."""
    with connect(server) as ws:
        ws.send(json.dumps({"type": "input.append", "text": "x" * (3 << 20)}))
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        err = events_until(ws, "error")[-1]["error"]
        assert (err["code"], err["param"]) == ("text_too_long", "text")
        assert str(MAX_APPEND_CHARS) in err["message"]
        ws.send(json.dumps({"type": "input.append", "text": "." * MAX_APPEND_CHARS}))
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        ws.send(json.dumps({"type": "speak"}))      # answered once the dots were cut
        assert events_until(ws, "error")[-1]["error"]["param"] == "type"
        ws.send(json.dumps({"type": "cancel"}))
        events_until(ws, "cancelled")
        ws.send(json.dumps({"type": "input.append", "text": "Fine. "}))
        ws.send(json.dumps({"type": "input.done"}))
        done = events_until(ws, "audio.done")
        assert [e["text"] for e in done if e["type"] == "clause.done"] == ["Fine."]


def test_websocket_text_not_yet_spoken_is_capped(server: Server) -> None:
    """Appends while nothing is spoken yet: once the session would hold more than
    MAX_PENDING_CHARS, the append is refused with an error event naming the limit (the old
    server submitted every clause and closed the socket once the queue was full)."""
    piece = "Word " * (MAX_APPEND_CHARS // 5)
    with connect(server) as ws:
        for _ in range(MAX_PENDING_CHARS // len(piece) + 1):
            ws.send(json.dumps({"type": "input.append", "text": piece}))
        err = events_until(ws, "error")[-1]["error"]
        assert (err["code"], err["param"]) == ("input_text_buffer_full", "text"), err
        assert str(MAX_PENDING_CHARS) in err["message"]
        ws.send(json.dumps({"type": "cancel"}))
        events_until(ws, "cancelled")


def test_one_websocket_cannot_fill_the_queue(server: Server) -> None:
    """1,500 appends of a sentence each on one socket: it holds at most MAX_CLAUSES_IN_FLIGHT
    of the server's --max-queue (256) slots, the rest wait in the session; another client is
    served meanwhile (the old server admitted every clause: 256, then 429 for everyone)."""
    with connect(server) as ws:
        ws.send(json.dumps({"type": "session.update", "session": {"voice": "bass"}}))
        events_until(ws, "session.updated")
        for _ in range(1500):
            ws.send(json.dumps({"type": "input.append", "text": "Hi there. "}))
        ws.send(json.dumps({"type": "speak"}))      # answered once every append was handled
        seen = events_until(ws, "error")
        assert seen[-1]["error"]["param"] == "type", seen[-1]
        assert server.metrics()[("omnistage_requests_in_flight", ())] <= MAX_CLAUSES_IN_FLIGHT
        r = server.post("/v1/audio/speech", json={"input": TEXT, "voice": "alto",
                                                  "response_format": "wav"})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(decode_audio(r.content)[0][0],
                                   expected_wave(TEXT, pitch=0), atol=LSB)
        seen += ready_events(ws)
        assert [e["error"]["param"] for e in seen if e["type"] == "error"] == ["type"]
        assert [e["text"] for e in seen if e["type"] == "clause.done"] == \
            ["Hi there."] * sum(e["type"] == "clause.done" for e in seen)
        ws.send(json.dumps({"type": "cancel"}))
        events_until(ws, "cancelled")


def test_websocket_clauses_over_the_share_wait_and_are_all_spoken_in_order(server: Server
                                                                           ) -> None:
    """More clauses than a session may have in flight, in one append: those over the share
    go in as earlier ones finish; every one is spoken, in order, as one file."""
    texts = [f"Clause {i}." for i in range(3 * MAX_CLAUSES_IN_FLIGHT + 1)]
    with connect(server) as ws:
        ws.send(json.dumps({"type": "session.update", "session": {"response_format": "pcm"}}))
        ws.send(json.dumps({"type": "input.append", "text": " ".join(texts) + " "}))
        ws.send(json.dumps({"type": "input.done"}))
        seen = events_until(ws, "audio.done")
    assert not [e for e in seen if e["type"] == "error"]
    assert [e["text"] for e in seen if e["type"] == "clause.done"] == texts
    assert seen[-1]["clauses"] == len(texts)
    pcm = b"".join(base64.b64decode(e["audio"]) for e in seen if e["type"] == "audio.delta")
    want = np.concatenate([expected_wave(t, pitch=0) for t in texts])
    np.testing.assert_allclose(decode_audio(pcm, "pcm16", RATE)[0][0], want, atol=LSB)
