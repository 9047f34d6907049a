"""The realtime session's parts without a server: Silero turn detection on speech-like audio
and on a tone, the input buffer's timeline, truncation of an assistant item, the session's
validation and merge."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.realtime.audio_buffer import AudioBuffer, decode_pcm16
from omnistage.entrypoints.openai.realtime.conversation import (Conversation, ConversationItem,
                                                                Part)
from omnistage.entrypoints.openai.realtime.protocol import Session, merge, parse
from omnistage.entrypoints.openai.realtime.vad import TurnDetector
from omnistage.testing.speech_like import pcm16, speech_like

RATE = 16000


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), np.float32)


def test_speech_between_silences_is_one_turn() -> None:
    detector = TurnDetector(threshold=0.5, silence_ms=500, prefix_padding_ms=300)
    audio = np.concatenate([silence(0.5), speech_like(1.5), silence(1.0)])
    events = []
    for i in range(0, len(audio), 1600):                # 100 ms appends, as a client sends
        events += detector.feed(audio[i:i + 1600])
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"]
    start, stop = events[0].ms, events[1].ms
    assert abs(start - (500 - 300)) <= 100              # speech onset less the padding
    assert 2000 + 500 <= stop <= 2000 + 500 + 200       # speech end plus the silence wanted


def test_a_pure_tone_is_not_speech() -> None:
    """Silero is a speech detector, not an energy gate: a loud 440 Hz tone starts no turn."""
    t = np.arange(2 * RATE) / RATE
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    assert TurnDetector(0.5, 500, 300).feed(tone) == []


def test_buffer_keeps_the_timeline_across_drops_and_takes() -> None:
    buf = AudioBuffer()
    for k in range(5):
        buf.append(np.full(100, k, np.float32))
    buf.drop_before(150)
    assert (buf.start, buf.num_samples) == (150, 350)
    head = buf.take(320)
    assert head.tolist() == [1.0] * 50 + [2.0] * 100 + [3.0] * 20
    assert buf.start == 320 and buf.take().tolist() == [3.0] * 80 + [4.0] * 100
    assert buf.num_samples == 0 and buf.end == 500


def test_input_audio_is_resampled_to_16k() -> None:
    audio = speech_like(0.5, rate=24000)
    samples = decode_pcm16(base64.b64encode(pcm16(audio)).decode(), 24000, "audio")
    assert samples.dtype == np.float32 and len(samples) == 8000
    with pytest.raises(APIError, match="even number of bytes"):
        decode_pcm16("AAAA", 16000, "audio")            # 3 bytes


def test_truncate_keeps_what_was_played() -> None:
    conv = Conversation(max_items=3)
    said = ConversationItem("assistant", [Part("audio", text="one two three four",
                                               num_samples=24000)])
    conv.add(ConversationItem("user", [Part("text", text="hi")]))
    conv.add(said)
    conv.truncate(said.id, 0, 500, 24000)               # half of the 1 s that was sent
    assert said.parts[0].text == "one two" and said.parts[0].num_samples == 12000
    assert said.status == "incomplete"
    assert conv.messages("Be brief.")[-1] == {"role": "assistant", "content": "one two"}
    with pytest.raises(APIError, match="audio_end_ms=900"):
        conv.truncate(said.id, 0, 900, 24000)
    conv.add(ConversationItem("user", [Part("text", text="more")]))
    with pytest.raises(APIError, match="limit of 3 items"):
        conv.add(ConversationItem("user", [Part("text", text="full")]))


def test_session_update_merges_and_names_bad_fields() -> None:
    base = Session().model_dump()
    s = parse(Session, merge(base, {"audio": {"input": {"turn_detection": None}}}), "session")
    assert s.audio.input.turn_detection is None and s.audio.output.format.rate == 24000
    with pytest.raises(APIError) as err:
        parse(Session, merge(base, {"audio": {"output": {"speed": 1.2}}}), "session")
    assert err.value.param == "session.audio.output.speed"
    with pytest.raises(APIError) as err:
        parse(Session, merge(base, {"tools": [{"type": "function"}]}), "session")
    assert err.value.param == "session.tools"
