"""MiMo-Audio cloning a voice, served: the tiny checkpoint (tests/helpers/mimo_audio.py, its audio
tokenizer at 8 kHz so that clips are taken) behind /v1/audio/voices, /v1/audio/speech and the
speech WebSocket and chat completions with audio out. An uploaded voice speaks, greedy, the same
audio every time, audio other than the preset voice's and another upload's, and the same as its
clip sent inline as ref_audio; the WebSocket speaks what the route speaks; a style instruction
changes the audio; a chat answered in an uploaded voice likewise. That the cloned prompt and the
codes spoken equal upstream's: tests/golden/models/test_mimo_audio_clone.py. Bad input (a clip
too short to upload, one too long for the model's context, an unknown voice in speech or chat)
is a 4xx with OpenAI's error JSON, and the server goes on."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
import yaml

from omnistage.configs import __file__ as configs_init
from omnistage.utils.audio import decode_audio
from tests.helpers.mimo_audio import build_tiny_mimo_audio
from tests.helpers.speech_routes import ws_speak

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "mimo-audio"
STEPS = 12
RATE = 8000          # the tiny audio tokenizer's rate here: 1 s of clip is 125 patches
TEXT = "Hello world."


def clip_wav(seconds: float, seed: int) -> bytes:
    import soundfile

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    soundfile.write(buf, (rng.standard_normal(int(seconds * RATE)) * 0.3).astype(np.float32),
                    RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
           ) -> Server:
    folder = build_tiny_mimo_audio(tmp_path_factory.mktemp("mimo_voices") / "model", 0.25, RATE)
    graph = yaml.safe_load((Path(configs_init).parent / "mimo_audio.yaml").read_text())
    graph["stages"][0]["ar"]["sampling"] = {"temperature": 0.0, "max_tokens": STEPS}
    path = tmp_path_factory.mktemp("graph") / "mimo_audio.yaml"
    path.write_text(yaml.safe_dump(graph))
    voices = tmp_path_factory.mktemp("voices")
    srv = start_server([str(folder), "--stage-config", str(path), "--served-model-name", MODEL,
                        "--voices-dir", str(voices)])
    for name, seconds, seed in (("ann", 1.0, 1), ("bob", 1.0, 2), ("long", 5.0, 3)):
        r = srv.post("/v1/audio/voices", data={"name": name, "consent": "true"},
                     files={"audio": (f"{name}.wav", clip_wav(seconds, seed), "audio/wav")})
        assert r.status_code == 200, r.text
    return srv


def speak(server: Server, **body: object) -> bytes:
    r = server.post("/v1/audio/speech", json={"model": MODEL, "input": TEXT,
                                              "response_format": "pcm", **body})
    assert r.status_code == 200, r.text
    assert len(r.content) > 0
    return r.content


def test_uploaded_voice_speaks_its_own_audio(server: Server) -> None:
    listed = [(v["name"], v["type"]) for v in server.get("/v1/audio/voices").json()["data"]]
    assert listed[:3] == [("default", "preset"), ("ann", "uploaded"), ("bob", "uploaded")]
    ann = speak(server, voice="ann")
    assert speak(server, voice="Ann") == ann                  # greedy: the same codes again
    assert speak(server, voice="default") != ann
    assert speak(server) != ann
    assert speak(server, voice="bob") != ann
    inline = base64.b64encode(clip_wav(1.0, 1)).decode()
    assert speak(server, ref_audio=inline) == ann
    styled = speak(server, voice="ann", instructions="Speak slowly.")
    assert styled != ann and speak(server, voice="ann", instructions="Speak slowly.") == styled
    assert speak(server, instructions="Speak slowly.") not in (styled, speak(server))


def test_websocket_speaks_the_uploaded_voice(server: Server) -> None:
    pcm, clauses = ws_speak(server.port, {"voice": "ann"}, TEXT)
    assert clauses == [TEXT]
    want = decode_audio(speak(server, voice="ann"), "pcm16", 24000)[0][0]
    got = decode_audio(pcm, "pcm16", 24000)[0][0]
    assert got.shape == want.shape and float(np.abs(got - want).max()) <= 1 / 32767 + 1e-6


def chat(server: Server, voice: str | None) -> tuple[str, bytes]:
    audio = {"format": "wav", **({"voice": voice} if voice else {})}
    r = server.post("/v1/chat/completions", json={
        "model": MODEL, "modalities": ["text", "audio"], "audio": audio, "temperature": 0.0,
        "max_tokens": STEPS, "messages": [{"role": "user", "content": "Hello there."}]})
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]["message"]["audio"]
    return out["transcript"], base64.b64decode(out["data"])


def test_chat_answers_in_the_uploaded_voice(server: Server) -> None:
    ann = chat(server, "ann")
    assert decode_audio(ann[1])[0].size > 0
    assert chat(server, "ann") == ann
    assert chat(server, None)[1] != ann[1] and chat(server, "bob")[1] != ann[1]


def test_voices_it_cannot_use_are_refused(server: Server) -> None:
    r = server.post("/v1/audio/voices", data={"name": "short", "consent": "true"},
                    files={"audio": ("short.wav", clip_wav(0.2, 4), "audio/wav")})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "audio"
    cases = [
        ("/v1/audio/speech", {"model": MODEL, "input": TEXT, "voice": "long"}, "ref_audio"),
        ("/v1/audio/speech", {"model": MODEL, "input": TEXT, "voice": "nobody"}, "voice"),
        ("/v1/chat/completions", {"model": MODEL, "modalities": ["text", "audio"],
                                  "audio": {"voice": "nobody", "format": "wav"},
                                  "messages": [{"role": "user", "content": "Hi"}]},
         "audio.voice"),
    ]
    for path, body, param in cases:
        r = server.post(path, json=body)
        assert 400 <= r.status_code < 500, (body, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"], err
        assert err["param"] == param, (body, err)
    assert speak(server, voice="ann")          # the server goes on
