"""From MiMo-Audio's generated patches to the tokenizer decoder's codes and a waveform, as
upstream's `MimoAudio.forward(..., return_audio=True)` does it: rows of [text, c0..c7] per frame;
the span after the first <|sostm|> patch and before the first <|eostm|> patch (else all);
frames whose channel 0 is empty dropped; decoded in segments of 1500 ids, concatenated."""

from __future__ import annotations

import torch
from torch import Tensor

from omnistage.models.mimo_audio.config import MiMoAudioConfig
from omnistage.models.mimo_audio.tokenizer_decoder import MiMoAudioTokenizerDecoder

SEGMENT = 1500


def patches_to_codes(flat: Tensor, cfg: MiMoAudioConfig, sostm_idx: int,
                     eostm_idx: int) -> Tensor:
    """flat (T * group_size * (1 + channels),) generated ids -> codes (channels, frames)."""
    g = cfg.group_size
    rows = flat.reshape(-1, cfg.audio_channels + 1).T                   # (1 + C, frames)
    text = rows[0, ::g]
    start = (text == sostm_idx).nonzero()
    end = (text == eostm_idx).nonzero()
    lo = int(start[0]) * g + g if len(start) else 0
    hi = int(end[0]) * g if len(end) else rows.shape[1]
    speech = rows[1:, lo:hi]
    speech = speech[:, speech[0] != cfg.empty_ids[0]]
    empties = torch.tensor(cfg.empty_ids, device=flat.device)[:, None]
    if not bool((speech < empties).all()):
        raise ValueError("an empty audio id inside a spoken frame")
    return speech.long()


def codes_to_wave(decoder: MiMoAudioTokenizerDecoder, codes: Tensor) -> Tensor:
    """codes (channels, frames) -> waveform (samples,) at decoder.sample_rate."""
    if codes.shape[1] == 0:
        return torch.zeros(decoder.sample_rate, device=codes.device)     # upstream: 1 s silence
    return torch.cat([decoder(codes[:, s:s + SEGMENT])
                      for s in range(0, codes.shape[1], SEGMENT)])
