"""A VibeVoice prompt's embeddings: the text ids' embeddings, with each voice clip's latent
frames (through the acoustic connector) in place of its run of audio placeholder ids.

The reference's processor writes, per speaker, `ceil(samples / hop)` audio ids where that
speaker's clip goes; the script follows as "Speaker 1: ...", "Speaker 2: ..." lines.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from omnistage.models.vibevoice.model import VibeVoiceForConditionalGeneration


def num_clip_frames(model: VibeVoiceForConditionalGeneration, num_samples: int) -> int:
    return math.ceil(num_samples / model.config.acoustic.hop_length)


@torch.inference_mode()
def prompt_embeds(model: VibeVoiceForConditionalGeneration, input_ids: Tensor,
                  clips: list[Tensor]) -> Tensor:
    """input_ids (T,) with one run of audio ids per clip, in order; clips: 24 kHz mono (N_i,)
    -> (T, H). A clip's frames are its encoder's mean latents (the reference with
    `sample=False`); clips are zero-padded to the longest's whole number of frames."""
    embeds = model.embed_input_ids(input_ids)
    if not clips:
        return embeds
    hop = model.config.acoustic.hop_length
    frames = [num_clip_frames(model, clip.numel()) for clip in clips]
    batch = torch.zeros(len(clips), 1, max(frames) * hop, dtype=embeds.dtype,
                        device=embeds.device)       # one batch, as the reference's processor
    for i, clip in enumerate(clips):
        batch[i, 0, :clip.numel()] = clip.to(batch)
    encoded = model.speech.encode_voice(batch)     # causal: the padding changes no frame
    rows = [encoded[i, :n] for i, n in enumerate(frames)]
    voice = torch.cat(rows)
    where = (input_ids == model.config.tokens.audio).nonzero()[:, 0]
    if len(where) != len(voice):
        raise ValueError(f"the prompt has {len(where)} audio placeholders, its clips "
                         f"{len(voice)} frames")
    embeds = embeds.clone()
    embeds[where] = voice
    return embeds
