"""The reference side of the VibeVoice golden tests: transformers' `generate` run on the tiny
random checkpoints of omnistage.testing.tiny_vibevoice."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from omnistage.testing.tiny_vibevoice import (AUDIO_BOS, AUDIO_TOKEN, LATENT, RATIOS, PagedLM,
                                              build_tiny_vibevoice)

__all__ = ["AUDIO_BOS", "AUDIO_TOKEN", "LATENT", "PagedLM", "build_tiny_vibevoice",
           "reference_generate", "reference_generate_with_clips"]


def reference_generate(root: Path, input_ids: list[int], seed: int, max_new_tokens: int,
                       guidance_scale: float, num_diffusion_steps: int,
                       extra: dict | None = None) -> dict:
    """transformers' generate for one request: its new ids, the diffusion head's latents
    (B = 1 rows, recorded from `_sample_audio_latent`) and its audio (N,)."""
    from transformers import VibeVoiceForConditionalGeneration as Reference

    ref = Reference.from_pretrained(root, dtype=torch.float32).eval()
    latents: list[Tensor] = []
    sample = ref._sample_audio_latent

    def record(*args, **kwargs):
        out = sample(*args, **kwargs)
        latents.append(out[:, 0].clone())
        return out

    ref._sample_audio_latent = record
    ids = torch.tensor([input_ids])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                           max_new_tokens=max_new_tokens, guidance_scale=guidance_scale,
                           num_diffusion_steps=num_diffusion_steps, return_dict_in_generate=True,
                           **(extra or {}))
    audio = out.audio[0]
    return {"tokens": out.sequences[0, len(input_ids):].tolist(),
            "latents": torch.cat(latents) if latents else torch.zeros(0, LATENT),
            "audio": audio.reshape(-1) if audio is not None else torch.zeros(0)}


def reference_generate_with_clips(root: Path, input_ids: list[int], clips: list[Tensor],
                                  seed: int, max_new_tokens: int, guidance_scale: float,
                                  num_diffusion_steps: int) -> dict:
    """`reference_generate` with voice clips (the processor's padded batch of clips and its
    padding mask), their latents taken without the encoder's noise (sample=False)."""
    hop = math.prod(RATIOS)        # the processor pads to a whole number of frames
    longest = -(-max(c.numel() for c in clips) // hop) * hop
    values = torch.zeros(len(clips), 1, longest)
    mask = torch.zeros(len(clips), longest, dtype=torch.bool)
    for i, c in enumerate(clips):
        values[i, 0, :c.numel()] = c
        mask[i, :c.numel()] = True
    return reference_generate(root, input_ids, seed, max_new_tokens, guidance_scale,
                              num_diffusion_steps,
                              extra={"input_values": values, "padding_mask": mask,
                                     "sample": False})
