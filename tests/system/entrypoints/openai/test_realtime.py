"""WebSocket /v1/realtime against a real server of the tiny random Qwen3-Omni: the official
`openai` client's realtime connection and a plain `websockets` client. Audio in, speech and its
transcript out; a second turn served from the prefix cache; server VAD on speech-like audio
(formant-synthesized vowels, omnistage/testing/speech_like.py: Silero hears them, pure tones
it does not) with barge-in; cancellation; bad events answered on a socket that stays usable;
the session limits; sockets dropped mid-answer leaving no request in any stage."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from websockets.sync.client import ClientConnection, connect

from omnistage.testing.speech_like import pcm16, speech_like

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "tiny-omni"
WAIT_S = 30
TEXT_ITEM = {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Tell me about the sea."}]}
MANUAL = {"audio": {"input": {"turn_detection": None}}}
RATE = 24000      # PCM16 as OpenAI's clients send it: a session that declares no rate takes 24 kHz


@pytest.fixture(scope="module")
def server(omni_server: Server) -> Server:
    """The package's tiny Qwen3-Omni server (conftest.py): its thinker never stops early, so
    an answer lasts max_output_tokens; idle timeout 3 s, turns 3 s, buffer 200000 bytes."""
    return omni_server


def session(server: Server, **update: Any) -> ClientConnection:
    ws = connect(f"ws://127.0.0.1:{server.port}/v1/realtime?model={MODEL}", open_timeout=WAIT_S)
    assert recv(ws)["type"] == "session.created"
    if update:
        send(ws, "session.update", session=update)
        ev = recv(ws)
        assert ev["type"] == "session.updated", ev
    return ws


def send(ws: ClientConnection, kind: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=WAIT_S))


def until(ws: ClientConnection, kind: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Events up to the first of `kind` (that one, and all before it)."""
    seen = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        seen.append(recv(ws))
        if seen[-1]["type"] == kind:
            return seen[-1], seen
    raise TimeoutError(f"no {kind} in {WAIT_S} s: {[e['type'] for e in seen]}")


def b64(samples: np.ndarray) -> str:
    return base64.b64encode(pcm16(samples)).decode("ascii")


def append(ws: ClientConnection, samples: np.ndarray, chunk_s: float = 0.1,
           rate: int = RATE) -> None:
    step = int(rate * chunk_s)
    for i in range(0, len(samples), step):
        send(ws, "input_audio_buffer.append", audio=b64(samples[i:i + step]))


def assert_nothing_in_flight(server: Server) -> None:
    """Every stage lets go of every request (the abort reached them all)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        m = server.metrics()
        held = {k: v for k, v in m.items() if k[0] in ("omnistage_stage_queue_length",
                                                       "omnistage_requests_in_flight") and v}
        if not held:
            return
        time.sleep(0.1)
    raise AssertionError(f"requests left in the engine: {held}")


def test_spoken_turn_with_the_official_client(server: Server) -> None:
    """Audio in, committed by hand; speech (PCM16 at 24 kHz) and its transcript out."""
    events: list[Any] = []
    with server.openai().realtime.connect(model=MODEL) as conn:
        def talk() -> None:
            conn.session.update(session={"type": "realtime", "max_output_tokens": 6,
                                         "audio": {"input": {"turn_detection": None},
                                                   "output": {"voice": "ethan"}}})
            conn.input_audio_buffer.append(audio=b64(speech_like(0.6, rate=RATE)))
            conn.input_audio_buffer.commit()
            conn.response.create()
            for ev in conn:
                events.append(ev)
                if ev.type in ("response.done", "error"):
                    return

        worker = threading.Thread(target=talk, daemon=True)
        worker.start()
        worker.join(WAIT_S)
        conn.close()
    assert not worker.is_alive(), [e.type for e in events]
    kinds = [e.type for e in events]
    assert "error" not in kinds, events[-1]
    assert kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    audio = b"".join(base64.b64decode(e.delta) for e in events
                     if e.type == "response.output_audio.delta")
    transcript = "".join(e.delta for e in events
                         if e.type == "response.output_audio_transcript.delta")
    done = events[-1].response
    assert done.status == "incomplete" and done.status_details.reason == "max_output_tokens"
    assert len(audio) > 0 and len(audio) % 2 == 0
    assert done.output[0].content[0].transcript == transcript
    assert done.audio.output.format.rate == 24000
    assert done.usage.output_token_details.text_tokens == 6
    assert done.usage.output_token_details.audio_tokens > 0
    assert done.usage.input_tokens > 10          # the audio's placeholders and the template


def test_second_turn_reuses_the_first_from_the_prefix_cache(server: Server) -> None:
    ws = session(server, max_output_tokens=4, instructions="You are a kind assistant.",
                 **MANUAL)
    with ws:
        append(ws, speech_like(0.8, rate=RATE, seed=1))
        send(ws, "input_audio_buffer.commit")
        send(ws, "response.create")
        first, events = until(ws, "response.done")
        sent = "".join(e["delta"] for e in events
                       if e["type"] == "response.output_audio_transcript.delta")
        send(ws, "conversation.item.create", item=TEXT_ITEM)
        send(ws, "response.create")
        second, _ = until(ws, "response.done")
    usage1, usage2 = first["response"]["usage"], second["response"]["usage"]
    assert first["response"]["output"][0]["content"][0]["transcript"] == sent
    assert usage1["input_token_details"]["cached_tokens"] == 0
    # the whole first turn (instructions, its audio, the answer) is context of the second;
    # everything up to the last whole block of its prompt comes from the cache
    assert usage2["input_tokens"] > usage1["input_tokens"]
    assert usage2["input_token_details"]["cached_tokens"] >= usage1["input_tokens"] // 16 * 16


def test_voice_detection_and_barge_in(server: Server) -> None:
    """Speech then silence: the server detects the turn and answers; speech during the
    answer cancels it at once (every stage lets go of it) and the item keeps what was sent."""
    silence = np.zeros(int(0.3 * RATE), np.float32)
    ws = session(server, max_output_tokens=400, audio={"input": {"turn_detection": {
        "type": "server_vad", "silence_duration_ms": 300, "prefix_padding_ms": 100}}})
    with ws:
        append(ws, np.concatenate([silence, speech_like(1.0, rate=RATE), silence, silence]))
        _, events = until(ws, "response.output_audio.delta")
        kinds = [e["type"] for e in events]
        assert kinds[:3] == ["input_audio_buffer.speech_started",
                             "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed"], kinds
        assert abs(events[0]["audio_start_ms"] - 200) <= 100          # 300 ms less the padding
        assert 1300 <= events[1]["audio_end_ms"] <= 1800
        append(ws, speech_like(0.5, rate=RATE, seed=3))                 # the user talks over it
        done, more = until(ws, "response.done")
        kinds = [e["type"] for e in more]
        assert "input_audio_buffer.speech_started" in kinds
        assert kinds.index("input_audio_buffer.speech_started") < kinds.index("response.done")
        response = done["response"]
        assert response["status"] == "cancelled"
        assert response["status_details"]["reason"] == "turn_detected"
        item = response["output"][0]
        sent = "".join(e["delta"] for e in events + more
                       if e["type"] == "response.output_audio_transcript.delta")
        assert item["status"] == "incomplete" and item["content"][0]["transcript"] == sent
        assert response["usage"]["output_token_details"]["text_tokens"] < 400
        assert_nothing_in_flight(server)


def heard_tokens(server: Server, audio: np.ndarray, rate: int, declare: bool) -> int:
    """The prompt tokens of one spoken turn: its audio placeholders grow with what the model
    hears, so equal durations give equal counts whatever the rate it was sent at."""
    update: dict[str, Any] = {"audio": {"input": {"turn_detection": None}}}
    if declare:
        update["audio"]["input"]["format"] = {"type": "audio/pcm", "rate": rate}
    ws = session(server, max_output_tokens=1, output_modalities=["text"], **update)
    with ws:
        append(ws, audio, rate=rate)
        send(ws, "input_audio_buffer.commit")
        send(ws, "response.create")
        done, _ = until(ws, "response.done")
    return done["response"]["usage"]["input_tokens"]


def test_undeclared_24k_and_declared_16k_are_heard_at_the_right_speed(server: Server) -> None:
    """OpenAI's clients send 24 kHz without declaring it (pcm16 is 24 kHz); a declared 16000
    is taken as such. 2 s either way is 2 s to the model; 3 s is more."""
    two_s = heard_tokens(server, speech_like(2.0, rate=24000), 24000, declare=False)
    assert heard_tokens(server, speech_like(2.0, rate=16000), 16000, declare=True) == two_s
    assert heard_tokens(server, speech_like(2.0, rate=24000), 24000, declare=True) == two_s
    assert heard_tokens(server, speech_like(2.9, rate=24000), 24000, declare=False) > two_s


def test_cancel_and_bad_events_leave_the_session_usable(server: Server) -> None:
    ws = session(server, max_output_tokens=400, **MANUAL)
    with ws:
        ws.send("not json")
        assert recv(ws)["error"]["code"] == "invalid_json"
        send(ws, "input_audio_buffer.frobnicate", event_id="evt_1")
        err = recv(ws)["error"]
        assert err["code"] == "invalid_event" and err["event_id"] == "evt_1"
        send(ws, "session.update", session={"audio": {"input": {"format": {"rate": 3}}}})
        assert recv(ws)["error"]["param"] == "session.audio.input.format.rate"
        send(ws, "session.update", session={"audio": {"output": {"voice": "nobody"}}})
        assert recv(ws)["error"]["code"] == "unknown_voice"
        send(ws, "input_audio_buffer.append", audio="***")
        assert recv(ws)["error"]["code"] == "invalid_audio"
        send(ws, "response.create")
        assert recv(ws)["error"]["code"] == "conversation_empty"
        send(ws, "conversation.item.create", item=TEXT_ITEM)
        send(ws, "response.create")
        until(ws, "response.created")
        send(ws, "response.cancel")
        done, _ = until(ws, "response.done")
        assert done["response"]["status"] == "cancelled"
        assert done["response"]["status_details"]["reason"] == "client_cancelled"
        send(ws, "response.cancel")
        assert until(ws, "error")[0]["error"]["code"] == "response_cancel_not_active"
        send(ws, "response.create", response={"output_modalities": ["text"],
                                              "max_output_tokens": 3})
        done, events = until(ws, "response.done")
        assert done["response"]["status"] == "incomplete"
        assert any(e["type"] == "response.output_text.delta" for e in events)
        assert not any(e["type"] == "response.output_audio.delta" for e in events)
    assert_nothing_in_flight(server)


def test_session_limits(server: Server) -> None:
    """Buffer bytes (the audio held, as PCM16 at the model's 16 kHz), turn length and
    idleness, as the server was started with."""
    ws = session(server, **MANUAL)
    with ws:
        append(ws, speech_like(3.5, rate=RATE), chunk_s=0.5)    # 112000 bytes held: under
        send(ws, "input_audio_buffer.commit")
        assert until(ws, "error")[0]["error"]["code"] == "turn_too_long"
        append(ws, np.zeros(RATE * 7, np.float32), chunk_s=3.5)     # 224000 bytes: over
        assert until(ws, "error")[0]["error"]["code"] == "input_audio_buffer_full"
        send(ws, "input_audio_buffer.clear")
        assert until(ws, "input_audio_buffer.cleared")
        idle_from = time.monotonic()
        assert until(ws, "error")[0]["error"]["code"] == "session_idle_timeout"
        assert 2.5 <= time.monotonic() - idle_from <= 10


def test_dropped_sockets_leave_no_request_anywhere(server: Server) -> None:
    """Twenty sessions at once, each answering, each socket dropped mid-answer (half right
    after the answer starts, half at its first audio): nothing of them stays in any stage,
    and the server still answers."""
    def one(i: int) -> None:
        ws = session(server, max_output_tokens=400, **MANUAL)
        send(ws, "conversation.item.create", item=TEXT_ITEM)
        send(ws, "response.create")
        until(ws, "response.created" if i % 2 else "response.output_audio.delta")
        ws.close()

    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            one(i)
        except BaseException as exc:     # reported by the test, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert_nothing_in_flight(server)
    assert server.get("/health").status_code == 200


def test_the_benchmark_clients(server: Server) -> None:
    """`omnistage bench realtime`'s clients (the benchmark serves its own model; here this
    server's): the fields its JSON reports."""
    from omnistage.benchmarks import realtime

    cfg = realtime.RealtimeBenchConfig(sizes="tiny", concurrency=(1, 2), turns=2,
                                       utterance_s=0.5, thinker_tokens=3, barge_ins=1,
                                       turn_taking=realtime.TurnTakingConfig(modes=()))
    # (turn-taking has its own test: test_realtime_bench_turns.py)
    ours = asyncio.run(realtime.measure(server.url, MODEL, cfg))
    head = realtime.headline(ours, cfg)
    assert all(0 < head[f"realtime_first_audio_s_c{c}"] < WAIT_S for c in (1, 2))
    assert ours["by_concurrency"]["2"]["turns"] == 4
    assert head["realtime_cached_fraction_c1"] > 0.3      # the first turn, of the second's
    barge = ours["barge_in"]
    assert head["realtime_barge_in_s"] == barge["barge_in_s"]["median"] < 5
    assert barge["stages_released_s"]["median"] >= head["realtime_barge_in_cancel_s"]


def test_text_model_is_refused_with_a_reason(text_server: Server) -> None:
    with connect(f"ws://127.0.0.1:{text_server.port}/v1/realtime",
                 additional_headers=text_server.headers, open_timeout=WAIT_S) as ws:
        err = recv(ws)
        assert err["type"] == "error" and err["error"]["code"] == "model_not_realtime"
        assert "audio" in err["error"]["message"]
