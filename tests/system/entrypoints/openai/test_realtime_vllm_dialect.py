"""WebSocket /v1/realtime in vLLM-Omni's dialect against a real server of the tiny random
Qwen3-Omni (conftest.py's `omni_server`, shared with test_realtime.py). The client here does
what vLLM-Omni's realtime client (examples/online_serving/qwen3_omni/openai_realtime_client.py
in vllm-project/vllm-omni) does, in its order: `session.update` with the model at the top
level, `input_audio_buffer.commit {final: false}`, PCM16 appends of 200 ms at 16 kHz, `commit
{final: true}`, no `response.create`; then it reads `response.output_audio.delta {audio,
sample_rate_hz}`, `transcription.delta` / `.done {text, usage}` until
`response.output_audio.done`, skipping what it does not know and raising on `error`, as that
client does. Bad events are answered with an `error` that names the field, on a socket that
stays usable."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
import wave
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from websockets.sync.client import ClientConnection, connect

from omnistage.testing.speech_like import pcm16, speech_like

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "tiny-omni"
WAIT_S = 60                   # a guard against a hang, not a timing assertion
CHUNK_BYTES = 16000 * 2 * 200 // 1000     # the client's default --chunk-ms 200 at 16 kHz
# the events the vLLM-Omni client reads (and the one it skips) in this dialect
VLLM_EVENTS = {"session.created", "transcription.delta", "transcription.done",
               "response.output_audio.delta", "response.output_audio.done", "error"}


@pytest.fixture(scope="module")
def server(omni_server: Server) -> Server:
    """The package's tiny Qwen3-Omni server (conftest.py): turns of at most 3 s."""
    return omni_server


def open_socket(server: Server) -> ClientConnection:
    return connect(f"ws://127.0.0.1:{server.port}/v1/realtime", open_timeout=WAIT_S,
                   max_size=64 * 1024 * 1024)


def send(ws: ClientConnection, kind: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=WAIT_S))


def next_error(ws: ClientConnection) -> dict[str, Any]:
    """The next event, which must be an `error`: its error object."""
    ev = recv(ws)
    assert ev["type"] == "error", ev
    return ev["error"]


def send_turn(ws: ClientConnection, pcm: bytes, model: str | None = MODEL) -> None:
    """The client's sends: session.update (model), commit final=false, appends, commit
    final=true."""
    if model is not None:
        send(ws, "session.update", model=model)
    send(ws, "input_audio_buffer.commit", final=False)
    for i in range(0, len(pcm), CHUNK_BYTES):
        send(ws, "input_audio_buffer.append",
             audio=base64.b64encode(pcm[i:i + CHUNK_BYTES]).decode("utf-8"))
    send(ws, "input_audio_buffer.commit", final=True)


def read_answer(ws: ClientConnection) -> dict[str, Any]:
    """The client's receive loop, with what it keeps (and every event, for the test)."""
    parts: list[bytes] = []
    rate, text_chunks, final_text, usage, events = 24000, [], "", None, []
    while True:
        ev = recv(ws)
        events.append(ev)
        kind = ev.get("type")
        if kind == "session.created":
            continue
        if kind == "response.output_audio.delta":
            if isinstance(ev.get("sample_rate_hz"), int) and ev["sample_rate_hz"] > 0:
                rate = ev["sample_rate_hz"]
            if ev.get("audio"):
                parts.append(base64.b64decode(ev["audio"]))
            continue
        if kind == "transcription.delta":
            if ev.get("delta"):
                text_chunks.append(ev["delta"])
            continue
        if kind == "transcription.done":
            final_text, usage = ev.get("text", "") or "".join(text_chunks), ev.get("usage")
            continue
        if kind == "response.output_audio.done":
            break
        if kind == "error":
            raise RuntimeError(f"Server error: {ev}")
    return {"pcm": b"".join(parts), "rate": rate, "deltas": text_chunks, "text": final_text,
            "usage": usage, "events": events}


def model_rate(server: Server) -> int:
    """The model's own output rate, read off a chat completion's WAV."""
    r = server.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 2, "modalities": ["text", "audio"],
        "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    wav = base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
    with wave.open(io.BytesIO(wav)) as f:
        return f.getframerate()


def test_the_vllm_omni_client_turn(server: Server) -> None:
    """One turn as the client runs it: speech (PCM16 at the model's rate) and its text out,
    usage in vLLM's words; no OpenAI response events besides."""
    with open_socket(server) as ws:
        send_turn(ws, pcm16(speech_like(1.0)))
        answer = read_answer(ws)
    kinds = [e["type"] for e in answer["events"]]
    assert set(kinds) <= VLLM_EVENTS and "error" not in kinds, kinds
    assert kinds[0] == "session.created" and kinds[-1] == "response.output_audio.done"
    assert kinds.index("transcription.done") == len(kinds) - 2
    assert answer["events"][-1]["has_audio"] is True
    deltas = [e for e in answer["events"] if e["type"] == "response.output_audio.delta"]
    assert deltas and all(e["format"] == "pcm16" for e in deltas)
    assert {e["sample_rate_hz"] for e in deltas} == {answer["rate"]} == {model_rate(server)}
    pcm = answer["pcm"]
    assert len(pcm) > 0 and len(pcm) % 2 == 0
    samples = np.frombuffer(pcm, "<i2")
    assert np.abs(samples).max() > 0                 # the tiny model's (random) speech
    assert answer["deltas"] and answer["text"] == "".join(answer["deltas"])
    usage = answer["usage"]
    assert usage["prompt_tokens"] > 10 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_second_turn_hears_the_first(server: Server) -> None:
    """The session keeps its conversation: the second turn's prompt holds the first turn,
    served from the prefix cache."""
    with open_socket(server) as ws:
        send_turn(ws, pcm16(speech_like(0.6, seed=1)))
        first = read_answer(ws)["usage"]
        send_turn(ws, pcm16(speech_like(0.6, seed=2)), model=None)
        second = read_answer(ws)["usage"]
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
    assert second["prompt_tokens_details"]["cached_tokens"] > 0


def test_concurrent_clients_and_a_dropped_socket(server: Server) -> None:
    """The client's --num-requests 3 --concurrency 3: three sessions answered at once; then a
    socket closed mid-answer leaves no request in any stage, and the server still answers."""
    answers: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def one(seed: int) -> None:
        try:
            with open_socket(server) as ws:
                send_turn(ws, pcm16(speech_like(0.5, seed=seed)))
                answers.append(read_answer(ws))
        except Exception as exc:      # noqa: BLE001 (reported by the test, not lost in the thread)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    assert not errors and len(answers) == 3, errors
    assert all(a["pcm"] and a["text"] for a in answers)
    with open_socket(server) as ws:
        send_turn(ws, pcm16(speech_like(0.5)))
        while recv(ws)["type"] != "response.output_audio.delta":
            pass
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        held = {k: v for k, v in server.metrics().items() if v and k[0] in (
            "omnistage_stage_queue_length", "omnistage_requests_in_flight")}
        if not held:
            break
        time.sleep(0.1)
    assert not held, f"requests left in the engine: {held}"
    assert server.get("/health").status_code == 200


def test_errors_are_read_as_the_client_reads_them(server: Server) -> None:
    """A model the server does not serve: the client's loop meets `error` and raises."""
    with open_socket(server) as ws, pytest.raises(RuntimeError, match="model_not_found"):
        send_turn(ws, pcm16(speech_like(0.5)), model="Qwen/Qwen3-Omni-30B-A3B-Instruct")
        read_answer(ws)


def test_bad_events_name_the_field_and_the_session_goes_on(server: Server) -> None:
    with open_socket(server) as ws:
        assert recv(ws)["type"] == "session.created"
        ws.send("not json")                 # no dialect yet: this frame cannot say whose
        assert next_error(ws)["code"] == "invalid_json"
        send(ws, "session.update", model=MODEL, voice="ethan")      # vLLM-Omni's from here
        err = next_error(ws)
        assert err["param"] == "voice" and err["code"] == "unknown_field"
        assert "session.update" in err["message"]
        send(ws, "session.update", model=7)
        assert next_error(ws)["param"] == "model"
        send(ws, "response.create", event_id="evt_1")
        err = next_error(ws)
        assert err["param"] == "type" and err["event_id"] == "evt_1"
        assert "input_audio_buffer.commit" in err["message"]
        send(ws, "input_audio_buffer.commit", final="yes")
        assert next_error(ws)["param"] == "final"
        send(ws, "input_audio_buffer.commit", final=True)
        assert next_error(ws)["code"] == "turn_not_open"
        send(ws, "input_audio_buffer.append", audio="***")
        assert next_error(ws)["code"] == "invalid_audio"
        send(ws, "input_audio_buffer.commit", final=False)
        send(ws, "input_audio_buffer.commit", final=False)
        assert next_error(ws)["code"] == "turn_already_open"
        send(ws, "input_audio_buffer.commit", final=True)
        assert next_error(ws)["code"] == "input_audio_buffer_commit_empty"
        send_turn(ws, pcm16(speech_like(3.5)), model=None)        # over the 3 s turn limit
        assert next_error(ws)["code"] == "turn_too_long"
        send_turn(ws, pcm16(speech_like(0.5)), model=None)        # and still it answers
        answer = read_answer(ws)
    assert answer["pcm"] and answer["text"]


def test_the_first_event_decides_for_the_whole_session(server: Server) -> None:
    """A session opened in OpenAI's dialect keeps it: `final` there is OpenAI's unknown
    field, and vLLM-Omni's events are not switched to midway."""
    with open_socket(server) as ws:
        assert recv(ws)["type"] == "session.created"
        send(ws, "session.update", session={"type": "realtime", "model": MODEL})
        assert recv(ws)["type"] == "session.updated"
        send(ws, "session.update", model=MODEL)
        assert next_error(ws)["param"] == "session"
