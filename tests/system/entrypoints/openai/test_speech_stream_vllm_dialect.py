"""WebSocket /v1/audio/speech/stream in vLLM-Omni's dialect, driven as its streaming speech
client (examples/online_serving/qwen3_tts/streaming_speech_client.py) drives it: session.config
first, input.text word by word, input.done; per sentence audio.start, binary frames, audio.done
{total_bytes}; session.done {total_sentences}; errors as {type: error, message}. The toy TTS
model speaks each character as a 10 ms tone of the voice's pitch."""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest

from omnistage.testing.toy_tts import RATE, expected_wave
from omnistage.utils.audio import decode_audio

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "toy-tts"
LSB = 1 / 32767 + 1e-6
WORDS = "Hello there. This is a test! One word at a time".split()


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
           ) -> Server:
    from omnistage.testing.toy_tts import build_toy_tts

    tts = build_toy_tts(tmp_path_factory.mktemp("toy_tts"), step_delay_s=0.02)
    return start_server([str(tts[0]), "--stage-config", str(tts[1]),
                         "--served-model-name", MODEL])


def connect(server: Server):
    from websockets.sync.client import connect as ws_connect

    return ws_connect(f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", open_timeout=30)


def read_session(ws, deadline_s: float = 60.0) -> tuple[list[dict], dict[int, bytes]]:
    """As the client reads: JSON events, and binary frames added to the current sentence."""
    events: list[dict] = []
    audio: dict[int, bytes] = {}
    current = -1
    while True:
        msg = ws.recv(timeout=deadline_s)
        if isinstance(msg, bytes):
            audio[current] = audio.get(current, b"") + msg
            continue
        event = json.loads(msg)
        events.append(event)
        if event["type"] == "audio.start":
            current = event["sentence_index"]
        if event["type"] in ("session.done", "error"):
            return events, audio


def speak(server: Server, config: dict, words: list[str]) -> tuple[list[dict], dict[int, bytes]]:
    with connect(server) as ws:
        ws.send(json.dumps({"type": "session.config", **config}))
        for word in words:
            ws.send(json.dumps({"type": "input.text", "text": word + " "}))
        ws.send(json.dumps({"type": "input.done"}))
        return read_session(ws)


def test_sentences_as_wav_files(server: Server) -> None:
    events, audio = speak(server, {"model": MODEL, "voice": "bass", "task_type": "CustomVoice",
                                   "language": "English"}, WORDS)
    starts = [e for e in events if e["type"] == "audio.start"]
    dones = [e for e in events if e["type"] == "audio.done"]
    texts = [e["sentence_text"] for e in starts]
    assert texts == ["Hello there.", "This is a test!", "One word at a time"]
    assert [e["sentence_index"] for e in dones] == [0, 1, 2]
    assert events[-1] == {"type": "session.done", "total_sentences": 3}
    for i, text in enumerate(texts):
        assert dones[i]["total_bytes"] == len(audio[i]) and "error" not in dones[i]
        with wave.open(io.BytesIO(audio[i])) as w:
            assert w.getframerate() == RATE and w.getsampwidth() == 2
            got = np.frombuffer(w.readframes(w.getnframes()), "<i2") / 32767
        np.testing.assert_allclose(got, expected_wave(text, pitch=1), atol=LSB)
        assert np.abs(got).max() > 0.05


def test_stream_audio_sends_pcm(server: Server) -> None:
    events, audio = speak(server, {"voice": "bass", "response_format": "wav",
                                   "stream_audio": True}, WORDS[:2])
    dones = [e for e in events if e["type"] == "audio.done"]
    assert len(dones) == 1 and dones[0]["total_bytes"] == len(audio[0])
    got = decode_audio(audio[0], "pcm16", RATE)[0][0]
    np.testing.assert_allclose(got, expected_wave("Hello there.", pitch=1), atol=LSB)


@pytest.mark.parametrize("field,value", [("max_new_tokens", 100), ("x_vector_only_mode", True),
                                         ("task_type", "Karaoke"), ("speed", 2.0),
                                         ("response_format", "ogg"), ("colour", "blue"),
                                         ("model", "other-model")])
def test_fields_we_cannot_honour_are_named(server: Server, field: str, value: object) -> None:
    with connect(server) as ws:
        ws.send(json.dumps({"type": "session.config", field: value}))
        event = json.loads(ws.recv(timeout=30))
    assert event["type"] == "error" and set(event) == {"type", "message"}
    assert field in event["message"]


def test_bad_messages_get_an_error_and_the_session_goes_on(server: Server) -> None:
    with connect(server) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "bass"}))
        ws.send("not json")
        ws.send(json.dumps({"type": "input.append", "text": "x"}))
        ws.send(json.dumps({"type": "input.text", "text": "Hi."}))
        ws.send(json.dumps({"type": "input.done"}))
        errors = [json.loads(ws.recv(timeout=30)) for _ in range(2)]
        events, audio = read_session(ws)
    assert [e["type"] for e in errors] == ["error", "error"]
    assert "input.append" in errors[1]["message"]
    assert events[-1] == {"type": "session.done", "total_sentences": 1}
    assert [e["total_bytes"] for e in events if e["type"] == "audio.done"] == [len(audio[0])]
