"""The pieces of one streamed chat choice, in each of the answer's forms. A stream asks a
choice's writer for its pieces as the request goes: `start`, `text` (new text), `audio`
(a new chunk of speech, encoded by `encode`, off the event loop), `end`; each piece is one
`chat.completion.chunk` choice.

    TextDeltas       OpenAI, text        role ""; content pieces; finish
    SpeechDeltas     OpenAI, speech      role; delta.audio pieces (see the class); finish
    TwoChoiceDeltas  vLLM-Omni, speech   choice i: the text (chunks marked modality "text");
                                         choice n + i: the audio, each chunk's delta.content a
                                         base64 audio file (modality "audio"), finish "stop"

vLLM-Omni's client joins the text of the "text" chunks and decodes each "audio" chunk's
content as a file of its own (wav unless the request's audio.format says another).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from omnistage.entrypoints.openai.protocol import (
    ChoiceLogprobs,
    DeltaAudio,
    DeltaMessage,
)
from omnistage.utils.audio import encode_audio_b64, to_pcm16


@dataclass(slots=True)
class Piece:
    """One choice of one chunk: the delta, its choice's index, why it ended (its last
    piece), and vLLM-Omni's modality tag (its two-choice form only)."""

    delta: DeltaMessage
    index: int
    finish: str | None = None
    modality: Literal["text", "audio"] | None = None
    logprobs: ChoiceLogprobs | None = None


class TextDeltas:
    """A text answer in OpenAI's shape: role (content ""), content pieces, the finish."""

    def __init__(self, index: int) -> None:
        self.index = index

    def start(self) -> list[Piece]:
        return [Piece(DeltaMessage(role="assistant", content=""), self.index)]

    def text(self, text: str) -> Piece:
        return Piece(DeltaMessage(content=text), self.index)

    def encode(self, wave: Tensor, rate: int) -> str:
        raise AssertionError("a text answer has no audio")

    def audio(self, b64: str) -> Piece:
        raise AssertionError("a text answer has no audio")

    def end(self, finish: str) -> list[Piece]:
        return [Piece(DeltaMessage(), self.index, finish)]


class SpeechDeltas(TextDeltas):
    """A spoken answer in OpenAI's shape, the `delta.audio` pieces in OpenAI's order:

        {"id": ID, "transcript": "Hi"}   {"transcript": " there"}   ...   (the text)
        {"id": ID, "data": B64}          {"data": B64}              ...   (pcm16 chunks)
        {"expires_at": T}                                                 (last)

    Transcript and audio pieces interleave as the stages make them; content stays null."""

    def __init__(self, index: int, audio_id: str, ttl_s: int) -> None:
        super().__init__(index)
        self.audio_id = audio_id
        self.ttl_s = ttl_s
        self._named: set[str] = set()        # the kinds of piece that carried the id already

    def _id(self, kind: str) -> str | None:
        if kind in self._named:
            return None
        self._named.add(kind)
        return self.audio_id

    def start(self) -> list[Piece]:
        return [Piece(DeltaMessage(role="assistant"), self.index)]

    def text(self, text: str) -> Piece:
        return Piece(DeltaMessage(audio=DeltaAudio(id=self._id("transcript"), transcript=text)),
                     self.index)

    def encode(self, wave: Tensor, rate: int) -> str:
        return base64.b64encode(to_pcm16(wave)).decode("ascii")

    def audio(self, b64: str) -> Piece:
        return Piece(DeltaMessage(audio=DeltaAudio(id=self._id("data"), data=b64)), self.index)

    def end(self, finish: str) -> list[Piece]:
        expires = DeltaAudio(expires_at=int(time.time()) + self.ttl_s)
        return [Piece(DeltaMessage(audio=expires), self.index),
                Piece(DeltaMessage(), self.index, finish)]


class TwoChoiceDeltas(TextDeltas):
    """A spoken answer in vLLM-Omni's form: completion i's text as choice i, its audio as
    choice n + i (n: the request's completions), every piece tagged with its modality."""

    def __init__(self, index: int, num_completions: int, fmt: str) -> None:
        super().__init__(index)
        self.audio_index = num_completions + index
        self.fmt = fmt

    def start(self) -> list[Piece]:
        return [Piece(DeltaMessage(role="assistant", content=""), self.index, None, "text"),
                Piece(DeltaMessage(role="assistant", content=""), self.audio_index, None,
                      "audio")]

    def text(self, text: str) -> Piece:
        return Piece(DeltaMessage(content=text), self.index, None, "text")

    def encode(self, wave: Tensor, rate: int) -> str:
        return encode_audio_b64(wave, rate, self.fmt)

    def audio(self, b64: str) -> Piece:
        return Piece(DeltaMessage(content=b64), self.audio_index, None, "audio")

    def end(self, finish: str) -> list[Piece]:
        return [Piece(DeltaMessage(), self.index, finish, "text"),
                Piece(DeltaMessage(), self.audio_index, "stop", "audio")]
