"""A Qwen3-TTS talker fed by a text LLM inside one graph (configs/voice_agent.yaml): the text
arrives as the LLM writes it, in pieces safe to speak (the `speakable_text` edge adapter,
stages/speakable.py), and the talker speaks it in the reference's streaming mode, where every
generated frame takes the next text row:

    first piece    -> the prompt (voice, language, the piece's first token), prefilled; the
                      piece's other tokens open the request's text stream
    later pieces   -> their tokens' rows appended to the stream; a decode that reaches the
                      stream's end waits for the next piece (the engine's open stream)
    LLM finished   -> tts_eos's row closes the stream (tts_pad after it, as a whole text)

So the audio is what the talker gives for the whole text (leading and trailing whitespace
stripped) fed along (`non_streaming_mode` false), whatever the pieces' timing: the first frames come while the LLM still writes. A
request whose LLM wrote nothing speakable finishes without audio.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from omnistage.ar.engine import AREngine
from omnistage.ar.inputs import StreamInput
from omnistage.errors import InputError
from omnistage.models.qwen3_tts.prompt import PromptBuilder, SpeechRequest
from omnistage.sampling_params import SamplingParams
from omnistage.stages.interface import StageResult


@dataclass(slots=True)
class _Written:
    params: SamplingParams
    speech: SpeechRequest        # the voice; its text is the first piece's
    started: bool = False


class WrittenText:
    """The talker's requests whose text an upstream stage writes: its engine, its prompt
    builder and how it reads a request's voice (`speech_request(text, extra)`)."""

    def __init__(self, engine: AREngine, builder: PromptBuilder,
                 speech_request: Callable[[str, dict], SpeechRequest]) -> None:
        self.engine, self.builder, self.speech_request = engine, builder, speech_request
        self.requests: dict[str, _Written] = {}
        self._done: list[StageResult] = []     # finished without speech, reported next step

    def add(self, request_id: str, params: SamplingParams) -> None:
        """The voice is checked now (an InputError fails the request at once)."""
        if params.extra.get("ref_text"):
            raise InputError("ref_text: in-context cloning needs the whole text; a voice "
                             "agent's text is written as it is spoken", param="ref_text")
        speech = self.speech_request(" ", params.extra)
        self.requests[request_id] = _Written(params, replace(speech, non_streaming_mode=False))

    def feed(self, request_id: str, text: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        engine, builder = self.engine, self.builder
        if not text.strip():     # leading or trailing whitespace (a piece starts before it)
            return
        if req.started:
            engine.extend_request(request_id, stream_embeds=builder.text_rows(text))
            return
        prompt = builder.build(replace(req.speech, text=text.lstrip()), text_open=True)
        engine.add_request(request_id, None, req.params, prompt.embeds, stream=StreamInput())
        engine.extend_request(request_id, stream_embeds=prompt.trailing
                              if prompt.trailing.shape[0] else None, stream_pad=prompt.pad)
        req.started = True

    def close(self, request_id: str) -> None:
        """The LLM is done: the text's end, or (nothing was spoken) the request's."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if req.started:
            self.engine.extend_request(request_id, stream_embeds=self.builder.eos_row(),
                                       close_stream=True)
        else:
            self._done.append(StageResult(request_id, finished=True, finish_reason="stop"))

    def abort(self, request_id: str) -> bool:
        """Forget the request; whether the engine holds it (the caller aborts it there)."""
        req = self.requests.pop(request_id, None)
        self._done = [r for r in self._done if r.request_id != request_id]
        return req is None or req.started

    @property
    def has_done(self) -> bool:
        return bool(self._done)

    def unspoken(self) -> list[StageResult]:
        """The results of requests that finished with nothing to speak."""
        done, self._done = self._done, []
        return done
