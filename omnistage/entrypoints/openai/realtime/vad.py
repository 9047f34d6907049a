"""Server voice detection for a realtime session: Silero VAD (the `silero-vad` package's
TorchScript weights, loaded straight from its data folder: importing the package would set
torch's thread count for the whole server) and the turn logic around it.

    16 kHz audio ─> 512-sample frames (32 ms) ─> speech probability per frame
        silent   p >= threshold                           ─> speech started at that frame
        speaking p <  threshold - 0.15 for silence_ms     ─> speech stopped, said at the end
                 (Silero's own hysteresis: a dip          of that silence (the frame that
                 inside a word does not end the turn)     completed it)

The network is loaded at the first audio a detector is fed, not when a session starts: a
session with turn detection off (manual commits, vLLM-Omni's dialect) never loads it.

Times are milliseconds since the session's first appended sample, as the protocol's
`audio_start_ms` / `audio_end_ms`; the start includes `prefix_padding_ms` of audio before the
detected speech, and the end the `silence_ms` heard after it, as OpenAI's server_vad does (its
audio_end_ms "includes the min_silence_duration_ms": the end of the audio the turn commits).
A stop also says how much silence that was (`VadEvent.silence_ms`): the speech itself ended at
`ms - silence_ms`.
"""

from __future__ import annotations

import importlib.util
import io
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from omnistage.entrypoints.openai.errors import APIError

FRAME = 512              # samples per frame at 16 kHz (Silero's window)
CONTEXT = 64             # samples of the previous frame Silero sees with each frame
RATE = 16000             # Silero's rate: the buffer's too (protocol.LISTEN_RATE)
HYSTERESIS = 0.15


@lru_cache(maxsize=1)
def silero() -> torch.jit.ScriptModule:
    """The 16 kHz network, loaded once per process and shared by every session: it is
    stateless (each session passes its own recurrent state and context), and TorchScript
    profiles a module on its first calls (about a second), which a module per session would
    pay again each time."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise APIError(500, "turn_detection server_vad needs the silero-vad package, which "
                            "this server lacks (pip install silero-vad); turn_detection null "
                            "(manual commits) works without it",
                       param="session.audio.input.turn_detection", code="server_vad_unavailable")
    path = Path(spec.submodule_search_locations[0]) / "data" / "silero_vad.jit"
    return torch.jit.load(io.BytesIO(path.read_bytes()), map_location="cpu").eval()._model


@dataclass(frozen=True, slots=True)
class VadEvent:
    kind: str            # "speech_started" | "speech_stopped"
    ms: int              # audio_start_ms (padding included) | audio_end_ms (silence included)
    silence_ms: int = 0  # speech_stopped: the silence heard before it, inside `ms`


class TurnDetector:
    """Speech start / stop over a stream of 16 kHz samples (numpy float32)."""

    def __init__(self, threshold: float, silence_ms: int, prefix_padding_ms: int) -> None:
        self.threshold, self.silence_ms, self.padding_ms = threshold, silence_ms, prefix_padding_ms
        self.model: torch.jit.ScriptModule | None = None     # silero(), at the first feed
        self.state = torch.zeros(0)                          # (2, 1, 128) after the first frame
        self.context = torch.zeros(1, CONTEXT)               # the samples before the frame
        self.pending = np.zeros(0, np.float32)   # samples short of a whole frame
        self.num_frames = 0                      # frames seen
        self.speaking = False
        self.silent_frames = 0

    @property
    def now_ms(self) -> int:
        return self.num_frames * FRAME * 1000 // RATE

    @torch.inference_mode()
    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        """The events the new samples bring (blocking: a few ms per second of audio; the
        first call also loads the network, once per process)."""
        if self.model is None:
            self.model = silero()
        audio = np.concatenate([self.pending, samples.astype(np.float32, copy=False)])
        whole = len(audio) // FRAME * FRAME
        self.pending = audio[whole:]
        events = []
        frames = torch.from_numpy(audio[:whole].copy()).view(-1, FRAME)
        for frame in frames:
            x = torch.cat([self.context, frame[None]], dim=1)    # (1, CONTEXT + FRAME)
            prob, self.state = self.model(x, self.state)
            self.context = x[:, -CONTEXT:]
            event = self._step(float(prob))
            self.num_frames += 1
            if event is not None:
                events.append(event)
        return events

    def _step(self, prob: float) -> VadEvent | None:
        if not self.speaking:
            if prob >= self.threshold:
                self.speaking, self.silent_frames = True, 0
                return VadEvent("speech_started", max(0, self.now_ms - self.padding_ms))
            return None
        if prob < self.threshold - HYSTERESIS:
            self.silent_frames += 1
            silence_ms = self.silent_frames * FRAME * 1000 // RATE
            if silence_ms >= self.silence_ms:     # this frame's end; the silence inside it
                self.speaking = False
                return VadEvent("speech_stopped", self.now_ms + FRAME * 1000 // RATE,
                                silence_ms)
        else:
            self.silent_frames = 0
        return None

    def force_stop(self) -> VadEvent | None:
        """End the turn now (the turn reached its length limit)."""
        if not self.speaking:
            return None
        self.speaking = False
        return VadEvent("speech_stopped", self.now_ms)
