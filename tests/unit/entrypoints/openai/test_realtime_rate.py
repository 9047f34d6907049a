"""The realtime session's input rate, without a server: a session that declares none takes
OpenAI's 24 kHz (`pcm16` / `audio/pcm` is PCM16 mono at 24 kHz) and hears it at the right
speed (the model's 16 kHz inside); a declared rate is kept; vLLM-Omni's dialect, whose client
sends 16 kHz without saying so, takes 16 kHz. And Silero loads only when turn detection has
audio to hear. A RealtimeConnection is driven in-process over a stand-in socket and engine
client: the events in are what a client sends, the events out are read as a client reads them.
"""

from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from starlette.websockets import WebSocketState

from omnistage.entrypoints.openai.realtime import vad
from omnistage.entrypoints.openai.realtime.audio_buffer import (
    decode_pcm16,
    samples_to_ms,
)
from omnistage.entrypoints.openai.realtime.connection import (
    RealtimeConnection,
    RealtimeLimits,
)
from omnistage.entrypoints.openai.realtime.protocol import LISTEN_RATE, Session
from omnistage.testing.speech_like import pcm16, speech_like

MODEL = "tiny-omni"
MANUAL = {"audio": {"input": {"turn_detection": None}}}


class FakeSocket:
    """The server side of a WebSocket: the client's frames in order, then a disconnect."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.incoming = [{"type": "websocket.receive", "text": json.dumps(e)} for e in events]
        self.incoming.append({"type": "websocket.disconnect"})
        self.sent: list[dict[str, Any]] = []
        self.application_state = WebSocketState.CONNECTED
        self.query_params = {"model": MODEL}

    async def accept(self) -> None:
        pass

    async def receive(self) -> dict[str, Any]:
        return self.incoming.pop(0)

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))

    async def close(self, code: int = 1000) -> None:
        self.application_state = WebSocketState.DISCONNECTED


def fake_client() -> Any:
    """What a session asks of the engine before any response: a model that hears and speaks."""
    return SimpleNamespace(processor=SimpleNamespace(input_modalities=("text", "audio")),
                           outputs={"text", "audio"}, max_model_len=None, metrics=None,
                           engine=SimpleNamespace(audio_sample_rate=24000))


def run_session(events: list[dict[str, Any]]) -> tuple[RealtimeConnection, list[dict[str, Any]]]:
    ws = FakeSocket(events)
    conn = RealtimeConnection(ws, fake_client(), MODEL, RealtimeLimits())   # type: ignore[arg-type]
    asyncio.run(conn.run())
    errors = [e for e in ws.sent if e["type"] == "error"]
    assert not errors, errors
    return conn, ws.sent


def append(audio: np.ndarray, rate: int, chunk_s: float = 0.1) -> list[dict[str, Any]]:
    """input_audio_buffer.append events of `audio` (at `rate`) in `chunk_s` pieces."""
    step = int(rate * chunk_s)
    return [{"type": "input_audio_buffer.append",
             "audio": base64.b64encode(pcm16(audio[i:i + step])).decode("ascii")}
            for i in range(0, len(audio), step)]


def test_a_session_that_names_no_rate_takes_openais_24k() -> None:
    session = Session()
    assert session.audio.input.format.rate == 24000
    assert session.audio.output.format.rate == 24000
    assert LISTEN_RATE == 16000                  # the model's rate, not the protocol's


@pytest.mark.parametrize("declared", [None, 24000, 16000, 8000, 44100])
def test_appended_audio_is_heard_at_its_real_duration(declared: int | None) -> None:
    """1.5 s sent at the session's rate is 1.5 s in the buffer (as 16 kHz samples)."""
    rate = declared or 24000
    update: dict[str, Any] = {"audio": {"input": {"turn_detection": None}}}
    if declared is not None:
        update["audio"]["input"]["format"] = {"type": "audio/pcm", "rate": declared}
    conn, sent = run_session([{"type": "session.update", "session": update},
                              *append(speech_like(1.5, rate=rate), rate)])
    assert sent[1]["session"]["audio"]["input"]["format"]["rate"] == rate
    assert conn.buffer.num_samples == int(1.5 * LISTEN_RATE)
    assert samples_to_ms(conn.buffer.num_samples) == 1500


@pytest.mark.parametrize("declared", [None, 16000])
def test_voice_detection_times_are_real_time(declared: int | None) -> None:
    """Server VAD over 0.5 s silence, 1 s speech, 1 s silence: speech_started at the onset
    less the padding, speech_stopped at its end plus the silence wanted; audio sent at 24 kHz
    undeclared and at a declared 16 kHz give the same times."""
    rate = declared or 24000
    detection = {"type": "server_vad", "silence_duration_ms": 500, "prefix_padding_ms": 300,
                 "create_response": False}
    update: dict[str, Any] = {"audio": {"input": {"turn_detection": detection}}}
    if declared is not None:
        update["audio"]["input"]["format"] = {"type": "audio/pcm", "rate": declared}
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech_like(1.0, rate=rate),
                            np.zeros(rate, np.float32)])
    _, sent = run_session([{"type": "session.update", "session": update},
                           *append(audio, rate)])
    started = [e for e in sent if e["type"] == "input_audio_buffer.speech_started"]
    stopped = [e for e in sent if e["type"] == "input_audio_buffer.speech_stopped"]
    assert len(started) == len(stopped) == 1, [e["type"] for e in sent]
    assert abs(started[0]["audio_start_ms"] - (500 - 300)) <= 100
    assert 1500 + 500 <= stopped[0]["audio_end_ms"] <= 1500 + 500 + 200
    assert any(e["type"] == "input_audio_buffer.committed" for e in sent)


def test_the_vllm_dialect_takes_16k_undeclared() -> None:
    """vLLM-Omni's client: session.update with a top-level model, commit final=false, then
    16 kHz PCM16 it never declares; 1 s of it is 1 s."""
    conn, _ = run_session([{"type": "session.update", "model": MODEL},
                           {"type": "input_audio_buffer.commit", "final": False},
                           *append(speech_like(1.0), 16000, chunk_s=0.2)])
    assert conn.session.audio.input.format.rate == 16000
    assert conn.session.audio.input.turn_detection is None
    assert samples_to_ms(conn.buffer.num_samples) == 1000


@pytest.fixture
def silero_loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each load of the Silero network, counted."""
    loads: list[int] = []
    real = vad.silero

    def counted() -> Any:
        loads.append(1)
        return real()

    monkeypatch.setattr(vad, "silero", counted)
    return loads


def test_silero_is_not_loaded_while_turn_detection_has_nothing_to_hear(
        silero_loads: list[int]) -> None:
    """A session opened (server_vad is the default) and switched to manual turns, or one in
    vLLM-Omni's dialect, never loads Silero; the first audio a detector hears does."""
    run_session([{"type": "session.update", "session": MANUAL},
                 *append(speech_like(0.5, rate=24000), 24000)])
    run_session([{"type": "session.update", "model": MODEL},
                 {"type": "input_audio_buffer.commit", "final": False},
                 *append(speech_like(0.5), 16000)])
    run_session([])                              # connected, default server_vad, no audio
    assert silero_loads == []
    conn, _ = run_session(append(np.zeros(2400, np.float32), 24000))
    assert silero_loads == [1] and conn.vad is not None and conn.vad.num_frames == 3


def test_declared_rates_outside_8k_to_48k_are_refused() -> None:
    ws = FakeSocket([{"type": "session.update", "event_id": "evt_9",
                      "session": {"audio": {"input": {"format": {"rate": 96000}}}}}])
    conn = RealtimeConnection(ws, fake_client(), MODEL, RealtimeLimits())   # type: ignore[arg-type]
    asyncio.run(conn.run())
    error = ws.sent[-1]["error"]
    assert error["param"] == "session.audio.input.format.rate" and error["event_id"] == "evt_9"
    assert conn.session.audio.input.format.rate == 24000          # the session as it was


def test_decode_resamples_to_the_models_rate() -> None:
    audio = pcm16(speech_like(0.25, rate=24000))
    b64 = base64.b64encode(audio).decode()
    assert len(decode_pcm16(b64, 24000, "audio")) == 4000
    assert len(decode_pcm16(base64.b64encode(pcm16(speech_like(0.25))).decode(), 16000,
                            "audio")) == 4000


def test_a_vllm_omni_server_starts_sessions_without_turn_detection() -> None:
    """A server answering in vLLM-Omni's shapes (`--omni`) starts each session with turn
    detection off, as vLLM-Omni's handler does: its e2e round trip (session.update {type,
    model}, appends, commit, response.create) sees no speech_started it did not expect. The
    OpenAI default stays server VAD; ServerConfig sets it by the dialect."""
    import dataclasses

    from omnistage.entrypoints.openai.api_server import ServerConfig

    assert ServerConfig().realtime_limits.server_vad is True
    vllm = dataclasses.replace(ServerConfig(), vllm_omni_launch=True)
    assert vllm.realtime_limits.server_vad is False
    speech = speech_like(1.2, 24000)
    events = [{"type": "session.update", "session": {"type": "realtime", "model": MODEL}},
              *append(speech, 24000)]
    ws = FakeSocket(events)
    conn = RealtimeConnection(ws, fake_client(), MODEL,   # type: ignore[arg-type]
                              vllm.realtime_limits)
    asyncio.run(conn.run())
    kinds = [e["type"] for e in ws.sent]
    assert kinds[0] == "session.created"
    assert ws.sent[0]["session"]["audio"]["input"]["turn_detection"] is None
    assert "input_audio_buffer.speech_started" not in kinds and "error" not in kinds
    assert conn.vad is None
