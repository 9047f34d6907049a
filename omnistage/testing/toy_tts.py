"""A toy text-to-speech model for the speech API's tests: text in, a deterministic waveform out
that depends on the text and the voice, streamed in several chunks through two stages, the way
Qwen3-TTS runs (talker -> code2wav):

    speaker (kind ar, component toy_tts_speaker)      vocoder (generation, toy_tts_vocoder)
    text, voice -> codes, CHARS_PER_STEP a step  ──>  codes -> tones, SAMPLES_PER_CHAR each
    code = pitch * 256 + (character % 256)            tone(pitch, character), final: audio

The pitch is the voice's: a preset's index in VOICES, or for a cloned voice one read from the
reference clip (its loudness), so a clone and each preset sound different. With instructions
the amplitude halves. Importing this module registers the "testing_tts" family (architecture
ToySpeechModel, speech spec: two presets, cloning, instructions); the production table in
omnistage/registry.py knows nothing of it. `build_toy_tts(folder)` writes a checkpoint folder
(config.json and a tiny tokenizer) and the graph to serve it with.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from omnistage.configs.options import NoOptions, read_options
from omnistage.configs.schema import StageConfig
from omnistage.errors import InputError
from omnistage.registry import Component, ModelFamily, SpeechSpec, register_family
from omnistage.payloads import SAMPLE_RATE, AudioChunk, Payload, TokenDelta
from omnistage.stages.adapters import StageFeed
from omnistage.stages.interface import EngineStats, StageInfo, StageRequest, StageResult

VOICES = ("alto", "bass")
RATE = 16000
SAMPLES_PER_CHAR = 160            # 10 ms of tone per character
CHARS_PER_STEP = 4                # one chunk of codes per step: several audio chunks a request
MAX_INPUT_CHARS = 400
ARCHITECTURE = "ToySpeechModel"


def voice_pitch(extra: dict) -> int:
    """0..7: a preset's index (the first preset without voice or clip), or 2..7 from the
    reference clip's loudness."""
    ref = extra.get("ref_audio")
    if ref is not None:
        samples = np.frombuffer(ref["samples"], dtype="<f4")
        level = float(np.sqrt(np.mean(samples ** 2))) if len(samples) else 0.0
        return 2 + int(level * 60) % 6
    voice = extra.get("voice", VOICES[0])
    if voice not in VOICES:
        raise InputError(f"voice {voice!r} is unknown (this model has: {', '.join(VOICES)})",
                         "voice")
    return VOICES.index(voice)


def tones(codes: Tensor) -> Tensor:
    """(n,) codes -> (n * SAMPLES_PER_CHAR,) float32 tones, amplitude in the code's top bit."""
    t = torch.arange(SAMPLES_PER_CHAR, dtype=torch.float64) / RATE
    pitch, char = (codes % 2048) // 256, codes % 256
    amp = torch.where(codes >= 2048, 0.25, 0.5).to(torch.float64)
    freq = (200.0 + 40.0 * pitch + 5.0 * (char % 64)).to(torch.float64)
    wave = amp[:, None] * torch.sin(2 * math.pi * freq[:, None] * t[None, :])   # (n, S)
    return wave.flatten().float()


@dataclass(frozen=True, slots=True)
class ToySpeakerOptions:
    """The toy talker's `ar.options`."""

    step_delay_s: float = 0.0      # a pause before each step (tests catch requests in flight)


class ToySpeakerStage:
    """The "talker": each step hands out the next CHARS_PER_STEP codes of every request
    (after `step_delay_s`, an option, so that tests can catch requests in flight)."""

    Options = ToySpeakerOptions

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        options = read_options(self.Options, stage.ar.options,
                               f"stage {stage.name!r}: ar.options")
        self.step_delay_s = options.step_delay_s
        self.requests: dict[str, list[int]] = {}

    def add(self, request: StageRequest) -> None:
        extra = request.params.extra if request.params is not None else {}
        loud = 2048 if extra.get("instructions") else 0
        pitch = voice_pitch(extra)
        text = request.prompt or ""
        self.requests[request.request_id] = [loud + pitch * 256 + ord(c) % 256 for c in text]

    def feed(self, request_id: str, feed: StageFeed) -> None:
        raise AssertionError("the toy speaker is an entry stage")

    def close_input(self, request_id: str) -> None:
        raise AssertionError("the toy speaker is an entry stage")

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def info(self) -> StageInfo:
        return StageInfo(speakers=tuple(VOICES))

    def stats(self) -> EngineStats:
        return EngineStats(len(self.requests))

    def step(self) -> list[StageResult]:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        results = []
        for rid, codes in list(self.requests.items()):
            chunk, rest = codes[:CHARS_PER_STEP], codes[CHARS_PER_STEP:]
            self.requests[rid] = rest
            results.append(StageResult(
                rid, token_ids=chunk, payload=Payload(tokens=TokenDelta(chunk)),
                finished=not rest, finish_reason=None if rest else "stop"))
            if not rest:
                del self.requests[rid]
        return results


def build_speaker(stage: StageConfig, model: str, device: str) -> ToySpeakerStage:
    return ToySpeakerStage(stage, model, device)


class ToyVocoder:
    """The "code2wav": codes -> tones, one chunk of audio per chunk of codes."""

    info: dict[str, str | int | float] = {SAMPLE_RATE: RATE}
    Options = NoOptions

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str,
                        device: torch.device, dtype: torch.dtype | None,
                        options: NoOptions = NoOptions()) -> ToyVocoder:
        return cls()

    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        deltas = [TokenDelta.unpack(x) for x in inputs]
        return [AudioChunk(tones(torch.tensor(d.token_ids))).pack() if d and d.token_ids
                else {} for d in deltas]

    def has_backlog(self, state: dict) -> bool:
        return False


def expected_wave(text: str, pitch: int, instructions: bool = False) -> np.ndarray:
    """What the toy says for `text` in the voice of `pitch` (the tests' reference)."""
    loud = 2048 if instructions else 0
    codes = torch.tensor([loud + pitch * 256 + ord(c) % 256 for c in text], dtype=torch.int64)
    return tones(codes).numpy()


def build_toy_tts(folder: Path, step_delay_s: float = 0.0) -> tuple[Path, Path]:
    """A checkpoint folder (config.json naming ToySpeechModel, a tiny tokenizer, a placeholder
    weight file: the loader checks for one) and the stage
    graph file to serve it with (`omnistage serve FOLDER --stage-config GRAPH`)."""
    from safetensors.torch import save_file

    from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE]}))
    save_file({"unused": torch.zeros(1)}, folder / "model.safetensors")  # the toy has no weights
    build_tiny_tokenizer(folder)
    graph = folder / "graph.yaml"
    graph.write_text(f"""
connector: shm
stages:
  - name: speaker
    kind: ar
    component: toy_tts_speaker
    ar:
      options: {{step_delay_s: {step_delay_s}}}
  - name: vocoder
    kind: generation
    component: toy_tts_vocoder
    inputs: [{{from: speaker, adapter: tokens_to_tensor, chunked: true}}]
    final: audio
""")
    return folder, graph


register_family(ModelFamily(
    "testing_tts", architectures=(ARCHITECTURE,),
    components=(Component("ar", "toy_tts_speaker", f"{__name__}:build_speaker"),
                Component("generation", "toy_tts_vocoder", f"{__name__}:ToyVocoder")),
    speech=SpeechSpec(voices=VOICES, cloning=True, instructions=True,
                      languages=("auto", "english", "chinese"),
                      max_input_chars=MAX_INPUT_CHARS)),
    module=__name__)
