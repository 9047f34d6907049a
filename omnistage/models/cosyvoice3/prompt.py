"""A CosyVoice3 request -> the LM's prefill rows and the flow's voice prompt, as upstream's
`CosyVoiceFrontEnd` + `CosyVoice3LM.inference` make them (FunAudioLLM/CosyVoice @ace7c47):

    zero-shot (ref_text):    LM [sos | prompt text, text | task | clip's speech tokens]
    instruct (instructions): LM [sos | instructions, text | task]          (inference_instruct2)
    cross-lingual (neither): LM [sos | text | task]                     (inference_cross_lingual)
    flow, every mode:        the clip's speech tokens, its mel, its CAM++ x-vector

A prompt text or instruction without `<|endofprompt|>` gets upstream's examples' system
prompt "You are a helpful assistant.<|endofprompt|>" in front (after the instruction, for an
instruction); cross-lingual text gets it in front of the text. The clip: speech tokens and
x-vector at 16 kHz (frontend.py), the mel at the vocoder's rate (features.prompt_mel), cut to
a common length (mel frames = token_mel_ratio * tokens), as upstream's frontend_zero_shot.
The LM speaks at least 2 and at most 20 tokens per text token (of the text alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from omnistage.models.cosyvoice3.config import CosyVoice3Config
from omnistage.models.cosyvoice3.features import SAMPLE_RATE, prompt_mel
from omnistage.models.cosyvoice3.frontend import ReferenceFrontEnd
from omnistage.models.cosyvoice3.llm import CosyVoice3LM
from omnistage.models.cosyvoice3.text import (ENDOFPROMPT_TEXT, SYSTEM_PROMPT, encode,
                                              load_tokenizer, normalize)
from omnistage.utils.audio import resample

MIN_TOKEN_TEXT_RATIO, MAX_TOKEN_TEXT_RATIO = 2, 20


@dataclass(frozen=True, slots=True)
class Clip:
    """The voice to clone: the clip's speech tokens (P,), mel (ratio * P, mel), x-vector."""
    tokens: Tensor
    mel: Tensor
    xvector: Tensor


@dataclass(frozen=True, slots=True)
class SpeechPrompt:
    embeds: Tensor          # the LM's prefill rows
    min_tokens: int
    max_tokens: int
    clip: Clip


class PromptBuilder:
    def __init__(self, folder: str | Path, cfg: CosyVoice3Config, lm: CosyVoice3LM,
                 device: str = "cpu") -> None:
        self.folder, self.cfg, self.lm, self.device = Path(folder), cfg, lm, device
        self.tokenizer = load_tokenizer(folder)
        self._front: ReferenceFrontEnd | None = None

    @property
    def front(self) -> ReferenceFrontEnd:
        if self._front is None:
            self._front = ReferenceFrontEnd(self.folder, self.device)
        return self._front

    def clip(self, samples: np.ndarray, rate: int) -> Clip:
        """A mono float32 clip at `rate` -> its tokens, mel and x-vector (ValueError naming
        ref_audio when it is too short, too long or not finite)."""
        if not np.isfinite(samples).all():
            raise ValueError("ref_audio: the reference clip has samples that are not finite")
        wav16 = torch.from_numpy(np.ascontiguousarray(resample(samples, rate, SAMPLE_RATE)))
        tokens, xvector = self.front(wav16)
        m = self.cfg.mel
        wav = samples if rate == m.rate else resample(samples, rate, m.rate)
        mel = prompt_mel(torch.from_numpy(np.ascontiguousarray(wav)), m.rate, m.n_fft, m.hop,
                         m.n_mels, m.fmin, m.fmax)
        ratio = self.cfg.flow.token_mel_ratio
        n = min(mel.shape[0] // ratio, tokens.numel())
        if n < 1:
            raise ValueError("ref_audio: the reference clip is too short to give a speech token")
        return Clip(tokens[:n], mel[:ratio * n], xvector)

    def ids(self, text: str, field: str) -> list[int]:
        ids = encode(self.tokenizer, text)
        vocab = self.lm.config.vocab_size
        if any(i >= vocab for i in ids):
            raise ValueError(f"{field}: a token this model's LM has no embedding for "
                             f"(vocabulary {vocab})")
        return ids

    @torch.no_grad()
    def build(self, text: str, clip: Clip, ref_text: str | None = None,
              instructions: str | None = None) -> SpeechPrompt:
        text = normalize(text)
        if not text:
            raise ValueError("input: no text to speak")
        speech = clip.tokens[:0]
        if instructions:
            prompt = normalize(instructions)
            if ENDOFPROMPT_TEXT not in prompt:
                prompt = f"You are a helpful assistant. {prompt}{ENDOFPROMPT_TEXT}"
            prompt_ids, text_ids = self.ids(prompt, "instructions"), self.ids(text, "input")
        elif ref_text:
            prompt = normalize(ref_text)
            if ENDOFPROMPT_TEXT not in prompt:
                prompt = SYSTEM_PROMPT + prompt
            prompt_ids, text_ids = self.ids(prompt, "ref_text"), self.ids(text, "input")
            speech = clip.tokens
        else:
            if ENDOFPROMPT_TEXT not in text:
                text = SYSTEM_PROMPT + text
            prompt_ids, text_ids = [], self.ids(text, "input")
        dev = self.lm.speech_embedding.weight.device
        embeds = self.lm.prompt_embeds(torch.tensor(prompt_ids + text_ids, device=dev),
                                       speech.to(dev))
        n = len(text_ids)
        return SpeechPrompt(embeds, int(n * MIN_TOKEN_TEXT_RATIO), int(n * MAX_TOKEN_TEXT_RATIO),
                            clip)
