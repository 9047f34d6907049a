"""Voxtral-TTS behind /v1/audio/speech: the tiny release-layout folder (params.json,
consolidated.safetensors, tekken.json, voice_embedding/; tests/helpers/voxtral_tts.py: the golden
fixtures' head and codec, a random backbone) served by `omnistage serve <folder>`. The audio of
a preset voice equals the golden path (the prompt of mistral-common's scaffold from tekken.json,
a cache-less loop over the golden parts, the codec decoder) on the same seed; every response
format; SSE streamed (the graph's first chunk of 2 frames, then the rest, each decoded with its
left context) equal to the whole; the presets listed; an unknown voice 400 naming `voice`."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest

from omnistage.utils.audio import decode_audio
from tests.helpers.voxtral_tts import build_folder, golden_audio

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "voxtral"
SEED, ALPHA, FRAMES, RATE = 5, 1.2, 10, 24000
TEXT = "Hello world, this is the thing!"
LSB = 1 / 32767 + 1e-4                 # 16-bit rounding, and the golden tests' 1e-4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_folder(tmp_path_factory.mktemp("voxtral_tts"))


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], folder: Path) -> Server:
    over = [f"speaker.ar.sampling.seed={SEED}", f"speaker.ar.options.cfg_alpha={ALPHA}",
            "speaker.ar.kv_cache.block_size=16", "speaker.ar.kv_cache.num_blocks=64",
            "speaker.ar.enforce_eager=true"]
    return start_server([str(folder), "--served-model-name", MODEL, "--device", "cpu",
                         "--dtype", "float32",
                         *[a for o in over for a in ("--stage-override", o)]])


def speak(server: Server, fmt: str, **kw: object) -> bytes:
    r = server.post("/v1/audio/speech", json={"model": MODEL, "input": TEXT,
                                               "response_format": fmt,
                                               "max_new_tokens": FRAMES, **kw}, timeout=300)
    assert r.status_code == 200, r.text
    return r.content


def test_speech_equals_the_golden_path_in_every_format(server: Server, folder: Path) -> None:
    want, per_frame = golden_audio(folder, TEXT, "casual_male", SEED, ALPHA, FRAMES)
    want = want.numpy()
    assert 0.02 < np.abs(want).mean() and np.abs(want).max() < 1, "silent or clipped"
    pcm = speak(server, "pcm", voice="casual_male")
    wave = decode_audio(pcm, "pcm16", RATE)[0][0]
    n = len(wave) // per_frame                      # the length-capped last frame is dropped
    assert len(wave) == n * per_frame and n >= FRAMES - 1, (len(wave), per_frame)
    np.testing.assert_allclose(wave, want[: len(wave)], atol=LSB, rtol=0)
    other = decode_audio(speak(server, "pcm", voice="neutral_female"), "pcm16", RATE)[0][0]
    assert other.shape != wave.shape or np.abs(other - wave).max() > 0.01   # the voice matters
    for fmt in ("wav", "flac"):                      # lossless: the same 16-bit samples
        got, rate = decode_audio(speak(server, fmt, voice="casual_male"))
        assert rate == RATE
        np.testing.assert_allclose(got[0], wave, atol=1.5 / 32767, rtol=0)
    for fmt in ("mp3", "opus", "aac"):               # lossy: the length
        got, rate = decode_audio(speak(server, fmt, voice="casual_male"))
        assert abs(got.shape[1] / rate - len(wave) / RATE) < 0.1, fmt
    events = server.post("/v1/audio/speech", json={
        "model": MODEL, "input": TEXT, "voice": "casual_male", "response_format": "pcm",
        "max_new_tokens": FRAMES, "stream_format": "sse"}, timeout=300)
    assert events.status_code == 200, events.text
    data = [json.loads(line[5:]) for line in events.text.splitlines() if line.startswith("data:")]
    assert data[-1]["type"] == "speech.audio.done", data[-1]
    deltas = [base64.b64decode(e["audio"]) for e in data if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and b"".join(deltas) == pcm      # streamed: 2 frames, then the rest


def test_presets_listed_and_an_unknown_voice_is_a_400(server: Server) -> None:
    r = server.get("/v1/audio/voices")
    assert r.status_code == 200 and "casual_male" in r.text and "neutral_female" in r.text
    r = server.post("/v1/audio/speech", json={"model": MODEL, "input": TEXT, "voice": "nobody"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "voice", r.text
