"""resume.py without a server: the journal a resume replays from (numbering, the byte cap,
acknowledgements, gaps), the grace period a client may ask for, and a session whose socket
dropped: kept for its grace period, then freed (the registry empty: nothing leaks)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.websockets import WebSocketState

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.realtime.connection import RealtimeConnection, RealtimeLimits
from omnistage.entrypoints.openai.realtime.resume import Journal, Sessions, grace_of


def test_journal_numbers_keeps_the_newest_and_replays_after_a_seq() -> None:
    journal = Journal(max_bytes=400)
    texts = [journal.record({"type": "x", "n": i}) for i in range(5)]
    assert [json.loads(t)["server_event_seq"] for t in texts] == [1, 2, 3, 4, 5]
    assert journal.after(2) == texts[2:] and journal.after(5) == []
    assert journal.after(6) is None                  # ahead of the last event
    for i in range(5, 20):                           # ~40 bytes each: the oldest go
        journal.record({"type": "x", "n": i})
    assert journal.num_bytes <= 400 and journal.after(2) is None
    oldest = journal.entries[0][0]
    assert journal.after(oldest - 1) is not None and journal.after(oldest - 2) is None


def test_journal_acknowledgements() -> None:
    journal = Journal(max_bytes=1 << 20)
    for i in range(4):
        journal.record({"type": "x", "n": i})
    journal.acknowledge(3)
    assert [s for s, _ in journal.entries] == [4] and journal.after(3) is not None
    assert journal.after(2) is None                  # acknowledged: gone
    for bad in (5, -1, "3", True):
        with pytest.raises(APIError, match="server_event_seq"):
            journal.acknowledge(bad)


def test_grace_period_of_the_query() -> None:
    assert grace_of({}, 30.0) == 30.0
    assert grace_of({"resume_grace_s": "2.5"}, 30.0) == 2.5
    assert grace_of({"resume_grace_s": "0"}, 30.0) == 0.0
    for bad in ("31", "-1", "soon", "nan"):
        with pytest.raises(APIError, match="resume_grace_s"):
            grace_of({"resume_grace_s": bad}, 30.0)
    with pytest.raises(ValueError, match="resume_grace_s"):
        RealtimeLimits(resume_grace_s=-1)


class DroppingSocket:
    """A socket that sends `events`, then drops with `code`."""

    def __init__(self, events: list[dict[str, Any]], code: int, query: dict[str, str]) -> None:
        self.incoming = [{"type": "websocket.receive", "text": json.dumps(e)} for e in events]
        self.incoming.append({"type": "websocket.disconnect", "code": code})
        self.sent: list[dict[str, Any]] = []
        self.application_state = WebSocketState.CONNECTED
        self.query_params = {"model": "m", **query}

    async def accept(self) -> None:
        pass

    async def receive(self) -> dict[str, Any]:
        message = self.incoming.pop(0)
        if message["type"] == "websocket.disconnect":
            self.application_state = WebSocketState.DISCONNECTED
        return message

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))

    async def close(self, code: int = 1000) -> None:
        self.application_state = WebSocketState.DISCONNECTED


def client() -> Any:
    """A model that speaks but does not hear (the voice agent's shape)."""
    return SimpleNamespace(processor=SimpleNamespace(), outputs={"text", "audio"},
                           max_model_len=None, engine=SimpleNamespace(audio_sample_rate=24000))


@pytest.mark.parametrize("code,kept", [(1006, True), (1001, True), (1000, False)])
def test_a_dropped_session_waits_its_grace_then_is_freed(code: int, kept: bool) -> None:
    async def main() -> None:
        sessions = Sessions()
        ack = {"type": "session.event_ack", "server_event_seq": 1}
        item = {"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}
        ws = DroppingSocket([item, ack], code, {"resume_grace_s": "0.05"})
        conn = RealtimeConnection(ws, client(), "m", RealtimeLimits(),   # type: ignore[arg-type]
                                  sessions)
        await conn.run()
        created = ws.sent[0]
        assert created["type"] == "session.created" and created["resume_token"].startswith("rt_")
        assert created["session"]["audio"]["input"]["turn_detection"] is None   # no ears
        assert [e["server_event_seq"] for e in ws.sent[1:]] == [1, 2]
        if kept:                                     # the acknowledged event left it
            assert conn.journal is not None and [s for s, _ in conn.journal.entries] == [2]
        else:
            assert conn.journal is None
        assert len(sessions) == int(kept) and conn.attached is False
        await asyncio.sleep(0.2)
        assert len(sessions) == 0 and conn.journal is None and conn.resume_token is None

    asyncio.run(main())
