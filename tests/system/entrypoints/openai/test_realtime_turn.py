"""semantic_vad on /v1/realtime against the shared tiny random Qwen3-Omni server: the session
takes it and echoes it, a bad eagerness is an `error` event naming the field on a socket that
goes on, and a spoken turn (speech-like audio, omnistage/testing/speech_like.py) is judged by
the served model's own end-of-turn score, committed and answered, with the turn-taking time
and the scores in /metrics. The random model's score for <|im_end|> is small, so the turn
ends at the eagerness's max wait (high: 2 s of silence); the decision itself, with scores
either side of the threshold, is tests/unit/entrypoints/openai/test_realtime_turn.py's."""

from __future__ import annotations

import base64
import json
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from websockets.sync.client import ClientConnection, connect

from omnistage.testing.speech_like import pcm16, speech_like

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "tiny-omni"
WAIT_S = 60
RATE = 24000
SEMANTIC = {"type": "semantic_vad", "eagerness": "high"}


@pytest.fixture(scope="module")
def server(omni_server: Server) -> Server:
    return omni_server


def connect_session(server: Server) -> ClientConnection:
    ws = connect(f"ws://127.0.0.1:{server.port}/v1/realtime?model={MODEL}", open_timeout=WAIT_S)
    assert recv(ws)["type"] == "session.created"
    return ws


def send(ws: ClientConnection, kind: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=WAIT_S))


def until(ws: ClientConnection, kind: str) -> list[dict[str, Any]]:
    """Events up to and including the first of `kind`."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        seen.append(recv(ws))
        if seen[-1]["type"] in (kind, "error"):
            return seen
    raise TimeoutError(f"no {kind} in {WAIT_S} s: {[e['type'] for e in seen]}")


def sample(server: Server, name: str, **labels: str) -> float:
    return server.metrics().get((name, tuple(sorted(labels.items()))), 0.0)


def test_semantic_vad_is_taken_echoed_and_checked(server: Server) -> None:
    with connect_session(server) as ws:
        send(ws, "session.update", session={"audio": {"input": {"turn_detection": SEMANTIC}}})
        updated = recv(ws)
        assert updated["type"] == "session.updated", updated
        assert updated["session"]["audio"]["input"]["turn_detection"] == {
            **SEMANTIC, "create_response": True, "interrupt_response": True}
        send(ws, "session.update", event_id="evt_7", session={"audio": {"input": {
            "turn_detection": {"type": "semantic_vad", "eagerness": "sometimes"}}}})
        error = recv(ws)
        assert error["type"] == "error", error
        assert error["error"]["param"] == "session.audio.input.turn_detection.eagerness"
        assert error["error"]["event_id"] == "evt_7"
        send(ws, "session.update", session={"audio": {"input": {"turn_detection": {
            "type": "server_vad", "silence_duration_ms": 400}}}})     # it goes on
        shown = recv(ws)["session"]["audio"]["input"]["turn_detection"]
        assert shown["type"] == "server_vad" and shown["silence_duration_ms"] == 400


def test_a_spoken_turn_is_judged_committed_and_answered(server: Server) -> None:
    before = {name + "".join(labels.values()): sample(server, f"omnistage_realtime_{name}",
                                                      **labels) for name, labels in [
        ("end_of_turn_score_count", {}), ("end_of_turn_score_sum", {}),
        ("turn_taking_seconds_count", {"decided_by": "max_wait"}),
        ("turn_taking_seconds_count", {"decided_by": "score"})]}
    audio = np.concatenate([np.zeros(RATE // 5, np.float32), speech_like(1.0, RATE, seed=11),
                            np.zeros(int(2.6 * RATE), np.float32)])
    with connect_session(server) as ws:
        send(ws, "session.update", session={"max_output_tokens": 6, "audio": {"input": {
            "turn_detection": SEMANTIC}}})
        assert recv(ws)["type"] == "session.updated"
        step = RATE // 10                # 100 ms appends in real time, as a microphone
        start = time.monotonic()
        for i in range(0, len(audio), step):
            time.sleep(max(0.0, start + i / RATE - time.monotonic()))
            send(ws, "input_audio_buffer.append",
                 audio=base64.b64encode(pcm16(audio[i:i + step])).decode("ascii"))
        events = until(ws, "response.done")
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed"], kinds
    assert events[2]["item_id"] == events[1]["item_id"]
    response = events[-1]["response"]
    assert response["status_details"]["reason"] == "max_output_tokens", response  # answered
    assert any(k == "response.output_audio.delta" for k in kinds)
    # the model scored the open turn (a prefill each time the pause doubled, from high's
    # 64 ms: 5 in its 2 s, more if Silero heard a pause inside the speech); a score (over
    # 0.3) or the max wait ended the turn (the random model's scores are small: the max wait)
    scored = sample(server, "omnistage_realtime_end_of_turn_score_count") - \
        before["end_of_turn_score_count"]
    assert 1 <= scored <= 10
    total = sample(server, "omnistage_realtime_end_of_turn_score_sum") - \
        before["end_of_turn_score_sum"]
    assert 0.0 <= total <= scored
    ended = [sample(server, "omnistage_realtime_turn_taking_seconds_count", decided_by=by) -
             before[f"turn_taking_seconds_count{by}"] for by in ("score", "max_wait")]
    assert sum(ended) == 1, ended
