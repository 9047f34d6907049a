"""The voice agent graph (a text LLM -> Qwen3-TTS, configs/voice_agent.yaml) behind chat
completions: a real server on the tiny Qwen3 LLM and the tiny Qwen3-TTS CustomVoice
checkpoint, asked through the official `openai` client for text and audio, whole and
streamed; a voice the talker lacks is a 400 naming it."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

import numpy as np
import openai
import pytest

from omnistage.stages.speakable import speakable
from omnistage.utils.audio import decode_audio

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "agent"
ASK = [{"role": "user", "content": "Tell me a story."}]
GREEDY_TALKER = {"sampling_params_list": [None, {"temperature": 0.0}, None]}


@pytest.fixture(scope="module")
def server(agent_server: Server) -> Server:
    return agent_server


def test_chat_answers_text_and_its_speech(server: Server) -> None:
    client = server.openai()
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, modalities=["text", "audio"], max_tokens=40,
        temperature=0, audio={"voice": "vivian", "format": "wav"})
    message = out.choices[0].message
    wave, rate = decode_audio(base64.b64decode(message.audio.data))
    assert rate == 24000 and wave.shape[1] > 0 and float(np.abs(wave).max()) > 0.01
    assert speakable(message.audio.transcript).strip()
    text_only = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                               temperature=0)
    assert text_only.choices[0].message.content == message.audio.transcript
    assert text_only.choices[0].message.audio is None


def test_streamed_speech_joins_to_the_whole_answer(server: Server) -> None:
    """Greedy LLM and talker: the streamed transcript and pcm16 pieces are the whole answer's."""
    client = server.openai()
    kw = dict(model=MODEL, messages=ASK, modalities=["text", "audio"], max_tokens=40,
              temperature=0, extra_body=GREEDY_TALKER)
    whole = client.chat.completions.create(**kw, audio={"voice": "vivian", "format": "wav"})
    chunks = list(client.chat.completions.create(
        **kw, audio={"voice": "vivian", "format": "pcm16"}, stream=True))
    audio = [c.choices[0].delta.audio for c in chunks
             if c.choices and c.choices[0].delta.audio is not None]
    transcript = "".join(a.transcript for a in audio if a.transcript is not None)
    pieces = [a.data for a in audio if a.data is not None]
    assert transcript == whole.choices[0].message.audio.transcript and len(pieces) >= 2
    streamed, _ = decode_audio(b"".join(base64.b64decode(p) for p in pieces), "pcm16", 24000)
    ref, _ = decode_audio(base64.b64decode(whole.choices[0].message.audio.data), "wav")
    assert streamed.shape == ref.shape and np.abs(streamed - ref).max() <= 2 / 32767


def test_an_unknown_voice_is_a_400(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="nobody"):
        server.openai().chat.completions.create(
            model=MODEL, messages=ASK, modalities=["text", "audio"], max_tokens=8,
            audio={"voice": "nobody", "format": "wav"})
