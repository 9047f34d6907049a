"""/v1/realtime on the voice agent graph (a text LLM -> Qwen3-TTS, configs/voice_agent.yaml),
one real server on the tiny Qwen3 LLM and the tiny Qwen3-TTS CustomVoice checkpoint: text
items in, speech and its transcript out, audio in refused with a clear error; and resumable
sessions (resume.py, vLLM-Omni's protocol): a socket dropped mid-answer reconnects with
`session.resume` and gets every event it missed, the conversation and the answer's audio
position intact; a second socket for a live session is refused; a session not resumed in its
grace period is freed, its answer aborted in every stage."""

from __future__ import annotations

import base64
import json
import socket
import time
from typing import TYPE_CHECKING, Any

import pytest
from websockets.sync.client import ClientConnection, connect


if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "agent"
WAIT_S = 60
ASK = {"type": "message", "role": "user",
       "content": [{"type": "input_text", "text": "Tell me a story about the sea."}]}
SESSION = {"audio": {"output": {"voice": "vivian"}}, "max_output_tokens": 24}


@pytest.fixture(scope="module")
def server(agent_server: Server) -> Server:
    """Greedy, and an LLM that never stops early: an answer lasts max_output_tokens."""
    return agent_server


def open_session(server: Server, query: str = "") -> tuple[ClientConnection, dict[str, Any]]:
    ws = connect(f"ws://127.0.0.1:{server.port}/v1/realtime?model={MODEL}{query}",
                 open_timeout=WAIT_S)
    created = recv(ws)
    assert created["type"] == "session.created", created
    send(ws, "session.update", session=SESSION)
    assert recv(ws)["type"] == "session.updated"
    return ws, created


def send(ws: ClientConnection, kind: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=WAIT_S))


def until(ws: ClientConnection, kind: str) -> list[dict[str, Any]]:
    """Events up to and with the first of `kind`."""
    seen = [recv(ws)]
    while seen[-1]["type"] != kind:
        seen.append(recv(ws))
    return seen


def drop(ws: ClientConnection) -> None:
    """The network goes: no close frame (the server sees 1006)."""
    ws.socket.shutdown(socket.SHUT_RDWR)
    ws.socket.close()


def resume(server: Server, **fields: Any) -> tuple[ClientConnection, dict[str, Any]]:
    ws = connect(f"ws://127.0.0.1:{server.port}/v1/realtime?resume=1", open_timeout=WAIT_S)
    send(ws, "session.resume", **fields)
    return ws, recv(ws)


def spoken(events: list[dict[str, Any]]) -> tuple[str, int]:
    """The transcript and the PCM16 bytes of the deltas among `events`."""
    text = "".join(e["delta"] for e in events
                   if e["type"] == "response.output_audio_transcript.delta")
    audio = sum(len(base64.b64decode(e["delta"])) for e in events
                if e["type"] == "response.output_audio.delta")
    return text, audio


def nothing_in_flight(server: Server) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        held = {k: v for k, v in server.metrics().items() if v and k[0] in (
            "omnistage_stage_queue_length", "omnistage_requests_in_flight")}
        if not held:
            return
        time.sleep(0.1)
    raise AssertionError(f"requests left in the engine: {held}")


def test_text_in_speech_and_transcript_out(server: Server) -> None:
    """The LLM has no ears: audio in is a clear error and the session goes on; a text item
    is answered in speech and its transcript (that speech starts while the LLM still writes
    is the golden test's: tests/golden/models/qwen3_tts/test_voice_agent.py)."""
    ws, created = open_session(server)
    assert created["session"]["audio"]["input"]["turn_detection"] is None
    send(ws, "input_audio_buffer.append", audio=base64.b64encode(b"\0" * 4800).decode())
    err = recv(ws)["error"]
    assert (err["code"], err["param"]) == ("audio_input_unsupported", "audio")
    assert "does not hear" in err["message"]
    send(ws, "conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": base64.b64encode(b"\0" * 4800).decode()}]})
    assert recv(ws)["error"]["param"] == "item.content[0].audio"
    send(ws, "conversation.item.create", item=ASK)
    send(ws, "response.create")
    events = until(ws, "response.done")
    text, audio = spoken(events)
    done = events[-1]["response"]
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    assert audio > 0 and text.strip()
    assert done["output"][0]["content"][0]["transcript"] == text
    assert done["usage"]["output_token_details"]["audio_tokens"] > 0
    ws.close()


def test_a_dropped_socket_resumes_mid_answer(server: Server) -> None:
    """Dropped at the answer's first audio, resumed from the last event it had: the events
    it missed arrive in order, none twice, and the answer joins up whole; the conversation
    (the answer's audio position included) is the session's as before."""
    ws, created = open_session(server, "&resume_grace_s=30")
    session_id, token = created["session"]["id"], created["resume_token"]
    send(ws, "conversation.item.create", item=ASK)
    send(ws, "response.create")
    before = until(ws, "response.output_audio.delta")
    drop(ws)
    last = before[-1]["server_event_seq"]
    ws, resumed = resume(server, session_id=session_id, resume_token=token,
                         last_received_server_event_seq=last)
    assert resumed["type"] == "session.resumed", resumed
    assert resumed["session"]["id"] == session_id and resumed["resume_token"] != token
    after = until(ws, "response.done")
    seqs = [e["server_event_seq"] for e in after]
    assert seqs == list(range(last + 1, last + 1 + len(seqs)))
    text, audio = spoken(before + after)
    done = after[-1]["response"]
    assert done["status"] == "incomplete" and done["output"][0]["content"][0]["transcript"] == text
    ms = audio // 2 * 1000 // 24000
    item_id = done["output"][0]["id"]
    send(ws, "conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=ms + 1)
    assert recv(ws)["error"]["message"].endswith(f"the item's audio is {ms} ms")
    send(ws, "conversation.item.create", item=ASK)
    send(ws, "response.create", response={"output_modalities": ["text"],
                                          "max_output_tokens": 2})
    second = until(ws, "response.done")[-1]["response"]
    assert second["usage"]["input_tokens"] > done["usage"]["input_tokens"] + len(text) // 8
    ws.close()


def test_one_socket_per_session_and_bad_resumes(server: Server) -> None:
    """A resume while the session's socket is attached, with a wrong token, for an unknown
    session, or after a clean close: each refused with its code; the live socket goes on."""
    ws, created = open_session(server)
    session_id, token = created["session"]["id"], created["resume_token"]
    cases = [({"resume_token": token}, "session_resume_conflict"),
             ({"resume_token": "rt_wrong"}, "invalid_resume_token"),
             ({"resume_token": token, "session_id": "sess_nobody"}, "session_resume_expired")]
    for fields, code in cases:
        other, err = resume(server, **{"session_id": session_id, **fields})
        assert err["type"] == "error" and err["error"]["code"] == code, err
        other.close()
    send(ws, "conversation.item.create", item=ASK)
    assert recv(ws)["type"] == "conversation.item.added"
    ws.close()                                  # code 1000: the session ends now
    time.sleep(0.5)
    other, err = resume(server, session_id=session_id, resume_token=token)
    assert err["error"]["code"] == "session_resume_expired"
    other.close()
    bad = connect(f"ws://127.0.0.1:{server.port}/v1/realtime?resume_grace_s=1e9",
                  open_timeout=WAIT_S)
    assert recv(bad)["error"]["param"] == "resume_grace_s"
    bad.close()


def test_a_session_not_resumed_in_its_grace_is_freed(server: Server) -> None:
    """Dropped mid-answer with a grace of 1 s: the answer is aborted in every stage, and the
    session is gone (a later resume is refused)."""
    ws, created = open_session(server, "&resume_grace_s=1")
    send(ws, "conversation.item.create", item=ASK)
    send(ws, "response.create", response={"max_output_tokens": 400})
    until(ws, "response.output_audio.delta")
    drop(ws)
    time.sleep(2.0)
    nothing_in_flight(server)
    other, err = resume(server, session_id=created["session"]["id"],
                        resume_token=created["resume_token"])
    assert err["error"]["code"] == "session_resume_expired"
    other.close()
