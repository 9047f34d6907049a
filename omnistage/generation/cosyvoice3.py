"""CosyVoice3's flow and vocoder as a generation-stage model: the LM stage's speech tokens in
(TokenDelta, a few a step) with the clone's voice prompt on the first chunk (VoicePrompt), the
waveform out once the request's input closes: the whole utterance, as upstream's
`CosyVoice3Model.tts` runs without `stream` (token2mel over prompt + all tokens, the DiT
unmasked, then HiFT with `finalize=True`), so there is no seam to measure.

Requests whose input closed in the same step share one flow call (the flow batches: a padded
row equals its run alone); the vocoder takes one utterance a call (models/cosyvoice3/hift.py:
its look-ahead would read a padded row's padding). The vocoder's source noise is
`SourceNoise.seeded(options.noise_seed, ...)` (upstream draws it from the global RNG when it
builds HiFT), the flow's noise upstream's fixed buffer (seed 0).

Not streamed yet: upstream's stream mode re-runs the flow on the tokens so far with the DiT's
chunk mask and the pre-lookahead layer's right context, and HiFT with overlap caches; this
port decodes the whole utterance (SSE sends it as one chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from omnistage.diffusion.pipelines.cosyvoice3 import CloneInput, fixed_noise, token2mel
from omnistage.models.cosyvoice3.hift import SourceNoise
from omnistage.models.cosyvoice3.model import CosyVoice3
from omnistage.payloads import SAMPLE_RATE, AudioChunk, TokenDelta, VoicePrompt

_TOKENS, _VOICE = "cosyvoice3.tokens", "cosyvoice3.voice"    # per-request state, not payloads


@dataclass(frozen=True, slots=True)
class CosyVoice3FlowOptions:
    """The stage's `generation.options`: num_steps, the flow's Euler steps (upstream: 10);
    noise_seed, the seed of the vocoder's source noise."""

    num_steps: int = 10
    noise_seed: int = 0

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps}: must be >= 1")


class CosyVoice3Generator:
    Options = CosyVoice3FlowOptions

    def __init__(self, model: CosyVoice3, device: torch.device,
                 options: CosyVoice3FlowOptions = CosyVoice3FlowOptions()) -> None:
        self.model, self.options = model, options
        self.noise = fixed_noise(model.cfg.flow.input_size, device)
        self.hop = model.cfg.hift.samples_per_frame
        self.info = {SAMPLE_RATE: model.sample_rate}

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None,
                        options: CosyVoice3FlowOptions = CosyVoice3FlowOptions()
                        ) -> CosyVoice3Generator:
        """The flow and HiFT run in float32 whatever the stage's dtype (as upstream's)."""
        if path is None:
            raise ValueError("the CosyVoice3 flow stage needs the checkpoint folder")
        return cls(CosyVoice3.from_pretrained(path, device), device, options)

    def has_backlog(self, state: dict) -> bool:
        return False

    @torch.inference_mode()
    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        ready: list[tuple[int, CloneInput]] = []
        for b, (x, state, last) in enumerate(zip(inputs, states, is_last)):
            delta, voice = TokenDelta.unpack(x), VoicePrompt.unpack(x)
            if delta is not None and delta.token_ids:
                state[_TOKENS] = state.get(_TOKENS, []) + list(delta.token_ids)
            if voice is not None:
                state[_VOICE] = voice
            if last and state.get(_TOKENS) and _VOICE in state:
                v = state[_VOICE]
                ready.append((b, CloneInput(torch.tensor(state[_TOKENS]), v.tokens.long(),
                                            v.mel.float(), v.xvector.float())))
        out: list[dict[str, Tensor]] = [{} for _ in inputs]
        for b, last in enumerate(is_last):
            if last:
                out[b] = AudioChunk(torch.zeros(0)).pack()       # nothing spoken: no audio
        if ready:
            mels = token2mel(self.model.flow, [c for _, c in ready], self.noise,
                             self.options.num_steps)
            for (b, _), mel in zip(ready, mels):
                out[b] = AudioChunk(self.vocode(mel)).pack()
        return out

    def vocode(self, mel: Tensor) -> Tensor:
        """(T, mel) -> (T * hop,) float32 on the CPU."""
        h = self.model.cfg.hift
        noise = SourceNoise.seeded(self.options.noise_seed, mel.shape[0] * self.hop,
                                   h.nb_harmonics + 1)
        wave, _ = self.model.hift(mel.T[None], noise)
        return wave.reshape(-1).float().cpu()
