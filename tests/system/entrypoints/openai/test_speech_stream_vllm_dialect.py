"""WebSocket /v1/audio/speech/stream in vLLM-Omni's dialect, driven as its streaming speech
client (examples/online_serving/qwen3_tts/streaming_speech_client.py) drives it: session.config
first, input.text word by word, input.done; per sentence audio.start, binary frames, audio.done
{total_bytes}; session.done {total_sentences}; errors as {type: error, message}. The toy TTS
model speaks each character as a 10 ms tone of the voice's pitch; vLLM-Omni's `max_new_tokens`
and `x_vector_only_mode` are checked on the tiny Qwen3-TTS Base checkpoint, against the HTTP
route's answer to the same request."""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
import soundfile

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


@pytest.mark.parametrize("field,value", [("max_new_tokens", 0), ("max_new_tokens", 5000),
                                         ("max_new_tokens", "100"), ("max_new_tokens", True),
                                         ("x_vector_only_mode", "yes"),
                                         ("x_vector_only_mode", True),    # not a clone
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


# ---- vLLM-Omni's max_new_tokens and x_vector_only_mode on the tiny Qwen3-TTS Base checkpoint -----

QWEN = "Qwen/Qwen3-TTS-12Hz-0.6B-base"


@pytest.fixture(scope="module")
def base(start_server: Callable[..., Server], qwen3_tts_ref: dict) -> Server:
    from tests.system.entrypoints.openai.test_speech_vllm_fields import qwen3_tts

    return qwen3_tts(start_server, qwen3_tts_ref, "base")


def clone_fields(**more: object) -> dict:
    """The fields of openai_speech_client.py's clone (its default voice sent along)."""
    from omnistage.testing.tiny_tts import CLIPS
    from tests.system.entrypoints.openai.test_speech_vllm_fields import data_url

    clip = io.BytesIO()
    soundfile.write(clip, CLIPS["xvector"], 24000, format="WAV", subtype="FLOAT")
    return {"model": QWEN, "voice": "Vivian", "task_type": "Base", "language": "English",
            "ref_audio": data_url(clip.getvalue()), "ref_text": "Hello world.",
            "response_format": "wav", **more}


def sentence_waves(server: Server, fields: dict, text: str) -> tuple[list[str], list[np.ndarray]]:
    events, audio = speak(server, fields, text.split())
    starts = [e for e in events if e["type"] == "audio.start"]
    assert events[-1] == {"type": "session.done", "total_sentences": len(starts)}, events
    assert not [e for e in events if "error" in e or e["type"] == "error"], events
    return ([e["sentence_text"] for e in starts],
            [decode_audio(audio[e["sentence_index"]])[0][0] for e in starts])


def http_wave(server: Server, fields: dict, text: str) -> np.ndarray:
    r = server.post("/v1/audio/speech", json={**fields, "input": text})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav", r.text
    return decode_audio(r.content)[0][0]


def test_x_vector_only_mode_clones_as_the_http_route_does(base: Server) -> None:
    """x_vector_only_mode true drops the transcript sent along: the sentence is the HTTP
    route's x-vector-only clone (test_speech_vllm_fields.py: the reference's), not the
    in-context one."""
    from omnistage.testing.tiny_tts import MAX_TOKENS

    waves = {}
    for x_vector in (True, False):
        fields = clone_fields(x_vector_only_mode=x_vector, max_new_tokens=MAX_TOKENS)
        texts, got = sentence_waves(base, fields, "The quick brown fox.")
        assert texts == ["The quick brown fox."]
        np.testing.assert_allclose(got[0], http_wave(base, fields, texts[0]), atol=LSB)
        waves[x_vector] = got[0]
    assert waves[True].shape != waves[False].shape or not np.allclose(waves[True], waves[False])


def test_max_new_tokens_caps_each_sentence(base: Server) -> None:
    """Without it the server's cap (64 frames) holds; with 2, each sentence is two frames of
    the same clone: shorter, and the HTTP route's answer with max_new_tokens 2."""
    text = "The quick brown fox. It jumps over the lazy dog."
    texts, full = sentence_waves(base, clone_fields(x_vector_only_mode=True), text)
    capped_fields = clone_fields(x_vector_only_mode=True, max_new_tokens=2)
    capped_texts, capped = sentence_waves(base, capped_fields, text)
    assert capped_texts == texts and len(texts) == 2
    for sentence, long, short in zip(texts, full, capped):
        assert 0 < short.shape[0] < long.shape[0]
        np.testing.assert_allclose(short, http_wave(base, capped_fields, sentence), atol=LSB)
