"""/v1/realtime with MiMo-Audio: a server of the tiny checkpoint (tests/helpers/mimo_audio.py,
its audio tokenizer at 16 kHz so that requests' audio can be resampled to it) holds a
half-duplex session as Qwen3-Omni's does (test_realtime.py): a spoken turn in, MiMo hears it
(its LLM stage encodes the audio into speech patches) and answers in speech and text. The
answer is what chat completions answers for the same audio and sampling (greedy): the same
transcript, and the same audio chunks, each resampled to the protocol's 24 kHz as the route
resamples them, within PCM16 rounding. The speech streams: several audio deltas a turn."""

from __future__ import annotations

import base64
import io
import json
import time
import wave
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import pytest
import yaml
from websockets.sync.client import connect

from omnistage.configs import __file__ as configs_init
from omnistage.testing.speech_like import pcm16, speech_like
from omnistage.utils.audio import decode_audio, resample
from tests.helpers.mimo_audio import build_tiny_mimo_audio

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "mimo-audio"
STEPS = 12
RATE = 16000           # the session's declared input rate, and the tiny tokenizer's here
LSB = 1 / 32767 + 1e-6
WAIT_S = 60


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory
           ) -> Server:
    folder = build_tiny_mimo_audio(tmp_path_factory.mktemp("mimo_rt") / "model", 0.25, RATE)
    graph = yaml.safe_load((Path(configs_init).parent / "mimo_audio.yaml").read_text())
    graph["stages"][0]["ar"]["sampling"] = {"temperature": 0.0, "max_tokens": STEPS}
    graph["stages"][1]["generation"] = {"options": {"chunk_frames": 8, "first_chunk_frames": 4}}
    path = tmp_path_factory.mktemp("graph") / "mimo_audio.yaml"
    path.write_text(yaml.safe_dump(graph))
    return start_server([str(folder), "--stage-config", str(path), "--served-model-name", MODEL])


def _wav(pcm: bytes) -> str:
    """PCM16 mono at RATE as a base64 WAV (the same int16 samples the realtime turn sends)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _realtime_turn(server: Server, pcm: bytes) -> tuple[str, list[bytes], dict]:
    """One spoken turn, committed by hand: (transcript, PCM16 deltas at 24 kHz, the
    response.done event)."""
    with connect(f"ws://127.0.0.1:{server.port}/v1/realtime?model={MODEL}",
                 open_timeout=WAIT_S) as ws:
        def send(kind: str, **fields: object) -> None:
            ws.send(json.dumps({"type": kind, **fields}))
        events = [json.loads(ws.recv(timeout=WAIT_S))]
        assert events[0]["type"] == "session.created", events[0]
        send("session.update", session={"type": "realtime", "max_output_tokens": STEPS,
                                         "audio": {"input": {"turn_detection": None, "format": {
                                             "type": "audio/pcm", "rate": RATE}}}})
        send("input_audio_buffer.append", audio=base64.b64encode(pcm).decode("ascii"))
        send("input_audio_buffer.commit")
        send("response.create")
        deadline = time.monotonic() + WAIT_S
        while events[-1]["type"] not in ("response.done", "error"):
            assert time.monotonic() < deadline, [e["type"] for e in events]
            events.append(json.loads(ws.recv(timeout=WAIT_S)))
    assert events[-1]["type"] == "response.done", events[-1]
    transcript = "".join(e["delta"] for e in events
                         if e["type"] == "response.output_audio_transcript.delta")
    audio = [base64.b64decode(e["delta"]) for e in events
             if e["type"] == "response.output_audio.delta"]
    return transcript, audio, events[-1]


def _chat(server: Server, pcm: bytes) -> tuple[str, list[np.ndarray], int]:
    """The same audio through chat completions, streamed: (transcript, audio chunks at the
    model's rate, that rate)."""
    body = {"model": MODEL, "temperature": 0.0, "max_tokens": STEPS, "stream": True,
            "modalities": ["text", "audio"], "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": _wav(pcm), "format": "wav"}}]}]}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    pieces = [d["audio"] for d in deltas if d.get("audio")]
    chunks = [decode_audio(base64.b64decode(p["data"]), "pcm16", RATE)[0][0]
              for p in pieces if p.get("data")]
    return "".join(p.get("transcript", "") for p in pieces), chunks, RATE


def test_spoken_turn_equals_the_chat_completions_answer(server: Server) -> None:
    pcm = pcm16(speech_like(0.2, rate=RATE))
    transcript, audio, done = _realtime_turn(server, pcm)
    text, chunks, rate = _chat(server, pcm)
    assert text and transcript == text
    response = done["response"]
    assert response["output"][0]["content"][0]["transcript"] == text
    assert response["usage"]["input_tokens"] > 10            # the speech patches and template
    assert len(audio) == len(chunks) >= 3, (len(audio), len(chunks))
    for got, chunk in zip(audio, chunks):
        want = resample(chunk, rate, 24000)
        heard = decode_audio(got, "pcm16", 24000)[0][0]
        assert heard.shape == want.shape
        assert float(np.abs(heard - want).max()) <= 4 * LSB    # PCM16 both ways
    assert float(np.abs(np.concatenate(chunks)).max()) > 0.01


def test_the_audio_changes_the_answer(server: Server) -> None:
    """MiMo hears the turn: another clip, another answer (greedy both)."""
    first, _, _ = _realtime_turn(server, pcm16(speech_like(0.2, rate=RATE)))
    other, _, _ = _realtime_turn(server, pcm16(0.5 * speech_like(0.3, rate=RATE, seed=3)))
    assert first and other and first != other
