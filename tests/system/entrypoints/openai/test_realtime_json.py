"""What /v1/realtime takes is what the HTTP routes take (json_body.py's policy): a lone
surrogate, NaN / Infinity, an integer beyond 64 bits, a non-object, an unknown event type:
each is answered with an `error` event (echoing the client's `event_id`) on a socket that
stays open and usable."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Iterator

import pytest
from websockets.sync.client import ClientConnection, connect

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "tiny-omni"
WAIT_S = 30


@pytest.fixture
def ws(omni_server: Server) -> Iterator[ClientConnection]:
    with connect(f"ws://127.0.0.1:{omni_server.port}/v1/realtime?model={MODEL}",
                 open_timeout=WAIT_S) as conn:
        assert recv(conn)["type"] == "session.created"
        yield conn


def recv(conn: ClientConnection) -> dict[str, Any]:
    return json.loads(conn.recv(timeout=WAIT_S))


def refused(conn: ClientConnection, raw: str) -> dict[str, Any]:
    """Send a raw frame; its `error` event, after checking the session still answers."""
    conn.send(raw)
    ev = recv(conn)
    assert ev["type"] == "error", ev
    conn.send(json.dumps({"type": "input_audio_buffer.clear", "event_id": "evt_alive"}))
    assert recv(conn)["type"] == "input_audio_buffer.cleared"
    return ev["error"]


# json.dumps would escape these; the frames hold the escapes as a client's JSON text does
SURROGATE_INSTRUCTIONS = ('{"type": "session.update", "event_id": "evt_s1", '
                          '"session": {"instructions": "be \\ud800 brief"}}')
SURROGATE_TEXT = ('{"type": "conversation.item.create", "event_id": "evt_s2", "item": '
                  '{"type": "message", "role": "user", "content": '
                  '[{"type": "input_text", "text": "low \\udfff high"}]}}')


def test_lone_surrogate_in_instructions(ws: ClientConnection) -> None:
    err = refused(ws, SURROGATE_INSTRUCTIONS)
    assert err["param"] == "session.instructions" and "surrogate" in err["message"]
    assert err["event_id"] == "evt_s1" and err["type"] == "invalid_request_error"


def test_lone_surrogate_in_a_text_item(ws: ClientConnection) -> None:
    err = refused(ws, SURROGATE_TEXT)
    assert err["param"] == "item.content[0].text" and "surrogate" in err["message"]
    assert err["event_id"] == "evt_s2"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity(ws: ClientConnection, constant: str) -> None:
    err = refused(ws, f'{{"type": "input_audio_buffer.clear", "event_id": "evt_n", '
                      f'"x": {constant}}}')
    assert err["code"] == "invalid_json" and constant.lstrip("-") in err["message"]
    assert err["event_id"] == "evt_n"


@pytest.mark.parametrize("number", [2**64 + 7, -2**63 - 1])
def test_integer_beyond_64_bits(ws: ClientConnection, number: int) -> None:
    err = refused(ws, f'{{"type": "input_audio_buffer.clear", "event_id": "evt_i", '
                      f'"padding": [1, {{"n": {number}}}]}}')
    assert err["param"] == "padding[1].n" and "64 bits" in err["message"]
    assert err["event_id"] == "evt_i"


@pytest.mark.parametrize("raw", ['[{"type": "input_audio_buffer.clear"}]', '"hello"', "42",
                                 "null", '{"type": "session.update"', "\x00"])
def test_not_an_event_object(ws: ClientConnection, raw: str) -> None:
    err = refused(ws, raw)
    assert err["code"] == "invalid_json" and err["event_id"] is None


def test_binary_frame(ws: ClientConnection) -> None:
    ws.send(b'{"type": "input_audio_buffer.clear"}')
    err = recv(ws)["error"]
    assert err["code"] == "invalid_json"


def test_unknown_event_type(ws: ClientConnection) -> None:
    err = refused(ws, '{"type": "response.frobnicate", "event_id": "evt_u"}')
    assert err["code"] == "invalid_event" and err["event_id"] == "evt_u"
    err = refused(ws, '{"type": 7, "event_id": "evt_u2"}')
    assert err["code"] == "invalid_event" and err["event_id"] == "evt_u2"


def test_nesting_too_deep(ws: ClientConnection) -> None:
    depth = 100_000
    err = refused(ws, '{"type": "input_audio_buffer.clear", "x": ' + "[" * depth
                  + "]" * depth + "}")
    assert err["code"] == "invalid_json"


def test_event_id_that_breaks_the_policy_is_not_echoed(ws: ClientConnection) -> None:
    err = refused(ws, '{"type": "input_audio_buffer.clear", "event_id": "e\\ud800", "x": NaN}')
    assert err["code"] == "invalid_json" and err["event_id"] is None
