"""Qwen3-TTS behind /v1/audio/speech: the tiny CustomVoice checkpoint (built by the `qwen-tts`
reference) served by a real server, asked through the official `openai` client; its preset
voices listed; an unknown voice refused; the WebSocket speaking words as they arrive. The
Base and VoiceDesign checkpoints' speech specs, and a clone's reference clip at another rate
resampled to the encoders' 24 kHz."""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Callable

import numpy as np
import openai
import pytest
import torch

from omnistage.registry import speech_spec
from omnistage.stages.qwen3_tts import REF_RATE, reference_waveform
from omnistage.utils.audio import decode_audio

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "qwen3-tts"


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], qwen3_tts_ref: dict,
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    return start_server([str(qwen3_tts_ref["root"] / "custom_voice"), "--served-model-name",
                         MODEL, "--device", "cpu",
                         "--voices-dir", str(tmp_path_factory.mktemp("voices"))])


def test_speech_from_a_preset_voice(server: Server) -> None:
    client = server.openai()
    wav = client.audio.speech.create(model=MODEL, voice="vivian", input="Hello world.",
                                     response_format="wav").content
    wave, rate = decode_audio(wav)
    assert rate == REF_RATE and wave.shape[1] > 0.1 * rate
    assert 0.01 < float(np.abs(wave).max()) <= 1.0
    voices = server.get("/v1/audio/voices").json()
    assert {"vivian", "dylan"} <= {v["name"] for v in voices["data"]}
    with pytest.raises(openai.BadRequestError, match="voice"):
        client.audio.speech.create(model=MODEL, voice="nobody", input="Hello world.")


def test_speech_specs_of_the_three_modes(qwen3_tts_ref: dict) -> None:
    root = qwen3_tts_ref["root"]
    custom, design, base = (speech_spec(root / m)
                            for m in ("custom_voice", "voice_design", "base"))
    assert set(custom.voices) == {"vivian", "dylan"} and custom.instructions and not custom.cloning
    assert design.voice_design and not design.voices and not design.cloning
    assert base.cloning and not base.voices and "auto" in base.languages


def test_a_clip_at_another_rate_is_resampled_to_24_khz() -> None:
    rate = 16000
    t = np.arange(rate) / rate
    clip = (0.3 * np.sin(2 * np.pi * 220 * t)).astype("<f4")
    wave = reference_waveform({"samples": clip.tobytes(), "sample_rate": rate})
    assert wave.shape == (REF_RATE,)
    spectrum = torch.fft.rfft(wave).abs()
    assert int(spectrum.argmax()) == 220                # 1 s: bin k is k Hz
    listed = reference_waveform(clip.tolist())          # samples as given: taken at 24 kHz
    assert listed.shape == (rate,)


def test_websocket_speaks_qwen3_tts_while_the_text_arrives(server: Server) -> None:
    """Words one by one: the first clause's audio arrives before `input.done` is sent."""
    from websockets.sync.client import connect

    def until(ws, kind: str) -> list[dict]:
        seen: list[dict] = []
        while not seen or seen[-1]["type"] not in (kind, "error"):
            seen.append(json.loads(ws.recv(timeout=120)))
        return seen

    url = f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream"
    with connect(url, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "session.update",
                            "session": {"voice": "dylan", "response_format": "pcm"}}))
        assert until(ws, "session.updated")[-1]["sample_rate"] == REF_RATE
        for word in "Hello there, this is".split():
            ws.send(json.dumps({"type": "input.append", "text": word + " "}))
        first = until(ws, "audio.delta")                    # before input.done
        ws.send(json.dumps({"type": "input.append", "text": "a test."}))
        ws.send(json.dumps({"type": "input.done"}))
        seen = first + until(ws, "audio.done")
    assert not [e for e in seen if e["type"] == "error"], seen
    assert [e["text"] for e in seen if e["type"] == "clause.done"] == ["Hello there,",
                                                                      "this is a test."]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in seen if e["type"] == "audio.delta")
    assert float(np.abs(decode_audio(pcm, "pcm16", REF_RATE)[0]).max()) > 0.01
