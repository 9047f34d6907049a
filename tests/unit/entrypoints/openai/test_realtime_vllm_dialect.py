"""vLLM-Omni's realtime dialect without a server: which first events choose it, the checks of
its three client events, and a response's OpenAI events relayed as the events its client
reads (tests/system/.../test_realtime_vllm_dialect.py runs the whole over a socket)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.realtime.vllm_dialect import (
    Relay,
    check_event,
    is_vllm_first,
    vllm_usage,
)


@pytest.mark.parametrize("msg, vllm", [
    ({"type": "session.update", "model": "m"}, True),
    ({"type": "input_audio_buffer.commit", "final": False}, True),
    ({"type": "input_audio_buffer.commit", "final": True}, True),
    ({"type": "session.update", "session": {"model": "m"}}, False),
    ({"type": "session.update", "model": "m", "session": {}}, False),
    ({"type": "input_audio_buffer.commit"}, False),
    ({"type": "input_audio_buffer.append", "audio": ""}, False),
    ({"type": "response.create"}, False),
])
def test_the_first_event_tells_the_dialect(msg: dict[str, Any], vllm: bool) -> None:
    assert is_vllm_first(msg) is vllm


@pytest.mark.parametrize("msg, param, code", [
    ({"type": "response.create"}, "type", "invalid_event"),
    ({"type": 3}, "type", "invalid_event"),
    ({"type": "session.update", "model": "m", "voice": "v"}, "voice", "unknown_field"),
    ({"type": "input_audio_buffer.append", "audio": "", "final": True}, "final",
     "unknown_field"),
    ({"type": "session.update", "model": None}, "model", None),
    ({"type": "input_audio_buffer.commit", "final": 1}, "final", None),
])
def test_bad_events_name_their_field(msg: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(APIError) as info:
        check_event(msg)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.code == code and info.value.message.startswith(param)


def test_good_events_pass() -> None:
    assert check_event({"type": "session.update", "model": "m", "event_id": "e"}) == \
        "session.update"
    assert check_event({"type": "input_audio_buffer.commit"}) == "input_audio_buffer.commit"


def test_usage_in_vllm_words() -> None:
    usage = {"total_tokens": 40, "input_tokens": 20, "output_tokens": 20,
             "input_token_details": {"cached_tokens": 16},
             "output_token_details": {"text_tokens": 5, "audio_tokens": 15}}
    assert vllm_usage(usage) == {"prompt_tokens": 20, "completion_tokens": 5,
                                 "total_tokens": 25,
                                 "prompt_tokens_details": {"cached_tokens": 16}}
    assert vllm_usage({"total_tokens": 0, "input_tokens": 0, "output_tokens": 0})[
        "total_tokens"] == 0


def relayed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(ev: dict[str, Any]) -> None:
        sent.append(ev)

    async def run() -> None:
        relay = Relay(send, 24000)
        for ev in events:
            await relay.send(ev)

    asyncio.run(run())
    return sent


IDS = {"response_id": "r", "item_id": "i", "output_index": 0, "content_index": 0}
OPENING = [{"type": "response.created", "response": {}},
           {"type": "response.content_part.added", **IDS, "part": {}}]
DELTAS = [{"type": "response.output_audio_transcript.delta", **IDS, "delta": "Hel"},
          {"type": "response.output_audio.delta", **IDS, "delta": "AAAA"},
          {"type": "response.output_audio_transcript.delta", **IDS, "delta": "lo"}]
CLOSING = [{"type": "response.output_audio.done", **IDS},
           {"type": "response.output_audio_transcript.done", **IDS, "transcript": "Hello"},
           {"type": "response.output_item.done", "item": {}}]


def test_a_response_relayed() -> None:
    usage = {"input_tokens": 9, "output_token_details": {"text_tokens": 2}}
    done = {"type": "response.done", "response": {"status": "incomplete", "usage": usage}}
    assert relayed(OPENING + DELTAS + CLOSING + [done]) == [
        {"type": "transcription.delta", "delta": "Hel"},
        {"type": "response.output_audio.delta", "audio": "AAAA", "format": "pcm16",
         "sample_rate_hz": 24000},
        {"type": "transcription.delta", "delta": "lo"},
        {"type": "transcription.done", "text": "Hello", "usage": {
            "prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
            "prompt_tokens_details": {"cached_tokens": 0}}},
        {"type": "response.output_audio.done", "has_audio": True}]


def test_a_failed_response_ends_with_error_then_done() -> None:
    error = {"type": "server_error", "code": "stage_failed", "message": "talker failed"}
    done = {"type": "response.done", "response": {
        "status": "failed", "status_details": {"type": "failed", "error": error}}}
    *_, err, last = relayed(OPENING + DELTAS[:1] + [done])
    assert err["type"] == "error" and err["error"]["message"] == "talker failed"
    assert err["error"]["code"] == "stage_failed"
    assert last == {"type": "response.output_audio.done", "has_audio": False}
