"""CosyVoice3 as two stages of the runtime: what upstream's `CosyVoice3.inference_zero_shot`
(and `_instruct2`, `_cross_lingual`) does in one call, split so the LM runs on the AR engine
with other requests.

    llm (ar)          the request's text and reference clip -> the LM's prefill rows
                      (models/cosyvoice3/prompt.py); speaks speech tokens until a stop id;
                      its first output also carries the clip's voice prompt (VoicePrompt)
    flow_hift (gen)   speech tokens + voice prompt -> mel (the flow's DiT, 10 cosine Euler
                      steps with CFG) -> 24 kHz waveform (HiFT) (generation/cosyvoice3.py)

The voice rides in `SamplingParams.extra` of the LM stage: "ref_audio" (required: samples at
24 kHz as a list of floats, or the speech API's {"samples": float32 little-endian bytes,
"sample_rate": int}), "ref_text" (its transcript: zero-shot cloning) or "instructions"
(instruct mode), "language" (accepted, unused: the text says its language). No preset voices.

Length: at least 2 and at most 20 speech tokens per text token, as upstream. Its min_len
suppresses only EOS (the first stop id) while our engine's min_tokens suppresses all 200 stop
ids, as vLLM's does (upstream's own vLLM path): the two differ only when another stop id would
be drawn within min_len (upstream's torch path then ends the utterance there).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from omnistage.configs.schema import StageConfig
from omnistage.errors import InputError
from omnistage.models.cosyvoice3.config import CosyVoice3Config
from omnistage.models.cosyvoice3.llm import CosyVoice3LM
from omnistage.models.cosyvoice3.prompt import Clip, PromptBuilder
from omnistage.models.cosyvoice3.text import TOKENIZER_FOLDER
from omnistage.payloads import SAMPLE_RATE, Payload, TokenDelta, VoicePrompt
from omnistage.registry import SpeechSpec
from omnistage.stages.ar import ARStage
from omnistage.stages.interface import StageRequest, StageResult
from omnistage.stages.voice import requested_voice
from omnistage.utils import trace
from omnistage.utils.audio import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE

VOICE_OPTIONS = ("instructions", "language", "ref_audio", "ref_text")
LIST_RATE = 24000            # ref_audio given as a list of samples: taken at 24 kHz


def speech_spec(path: str | Path) -> SpeechSpec:
    """A voice cloned from a reference clip, optionally with a style instruction."""
    return SpeechSpec(cloning=True, instructions=True)


def reference_clip(value: object) -> tuple[np.ndarray, int]:
    """A request's `ref_audio` -> (float32 samples, rate)."""
    if not isinstance(value, dict):
        try:
            return np.asarray(value, dtype=np.float32).reshape(-1), LIST_RATE
        except (TypeError, ValueError) as exc:
            raise InputError(f"ref_audio: expected samples ({exc})", param="ref_audio") from None
    try:
        samples, rate = np.frombuffer(value["samples"], dtype="<f4"), int(value[SAMPLE_RATE])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"ref_audio: expected samples at 24 kHz or {{samples: float32 bytes, "
                         f"sample_rate}} ({exc})", param="ref_audio") from None
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise InputError(f"ref_audio: sample_rate {rate} Hz is outside {MIN_SAMPLE_RATE} to "
                         f"{MAX_SAMPLE_RATE} Hz", param="ref_audio")
    return samples.astype(np.float32), rate


def _input_error(exc: ValueError) -> InputError:
    msg = str(exc)
    field = msg.split(":", 1)[0] if ":" in msg else "input"
    return InputError(msg, param=field if field.isidentifier() else "input")


class CosyVoice3LMStage(ARStage):
    """The speech-token LM on the AR engine, an entry stage. The engine reads the decoder's
    config from CosyVoice-BlankEN/; the weights come from the folder's llm.pt."""

    def __init__(self, stage: StageConfig, model: str, device: str) -> None:
        self.folder = Path(stage.model or model)
        self.cfg = CosyVoice3Config.from_folder(self.folder)
        size = self.cfg.speech_token_size

        def load(path, dev, dtype):
            lm = CosyVoice3LM.from_pretrained(self.folder, size, dev, dtype)
            return lm, lm.model_config, None

        stage = replace(stage, model=str(self.folder / TOKENIZER_FOLDER))
        super().__init__(stage, str(self.folder / TOKENIZER_FOLDER), device, loader=load)
        self.builder = PromptBuilder(self.folder, self.cfg, self.engine.model, device)
        self._voice: dict[str, Clip] = {}      # request -> voice prompt not yet emitted

    def add(self, request: StageRequest) -> None:
        params = request.params or self.defaults
        if request.streamed:
            raise ValueError("the CosyVoice3 LM is an entry stage")
        extra = params.extra
        voice = requested_voice(extra, takes=VOICE_OPTIONS)
        if voice is not None:
            raise InputError(f"voice: CosyVoice3 has no preset voice {voice!r}; it clones "
                             "the voice of ref_audio (or an uploaded voice)", param="voice")
        if extra.get("ref_audio") is None:
            raise InputError("ref_audio: CosyVoice3 clones a voice from a reference clip "
                             "(ref_audio, or an uploaded voice)", param="ref_audio")
        start = time.time()
        try:
            clip = self.builder.clip(*reference_clip(extra["ref_audio"]))
            prompt = self.builder.build(request.prompt or "", clip, extra.get("ref_text"),
                                        extra.get("instructions"))
        except ValueError as exc:
            raise _input_error(exc) from None
        trace.span("cosyvoice3.prompt", start, request=request.request_id)
        lm: CosyVoice3LM = self.engine.model
        cap = prompt.max_tokens if params.max_tokens is None else min(params.max_tokens,
                                                                     prompt.max_tokens)
        params = replace(params, min_tokens=min(prompt.min_tokens, cap), max_tokens=cap,
                         stop_token_ids=lm.stop_token_ids, detokenize=False)
        self.engine.add_request(request.request_id, None, params, prompt.embeds)
        self._voice[request.request_id] = clip

    def abort(self, request_id: str) -> None:
        self._voice.pop(request_id, None)
        super().abort(request_id)

    def step(self) -> list[StageResult]:
        results, size = [], self.cfg.speech_token_size
        for out in self.engine.step():
            tokens = [t for t in out.new_token_ids if t < size]
            clip = self._voice.pop(out.request_id, None)
            payload = Payload(tokens=TokenDelta(tokens), voice_prompt=None if clip is None
                              else VoicePrompt(clip.tokens, clip.mel, clip.xvector))
            results.append(StageResult(
                out.request_id, tokens, "", payload, out.finished,
                out.finish_reason.value if out.finish_reason else None, out.error))
            if out.finished:
                self._voice.pop(out.request_id, None)
        return results


def build_stage(stage: StageConfig, model: str, device: str) -> ARStage:
    return CosyVoice3LMStage(stage, model, device)
