"""Qwen2.5-Omni's audio encoder (HF `Qwen2_5OmniAudioEncoder`) in plain PyTorch, loaded from the
`thinker.audio_tower.*` tensors of the one Qwen2.5-Omni checkpoint.

    mel (num_mel, total_frames), feature_lens (num_audios,)
      -> split every audio into chunks of 2*n_window frames (the last one shorter)
      -> Conv1d k3 + GELU (padding frames zeroed) -> Conv1d k3 stride 2 + GELU -> (chunk, T', d)
      -> + sinusoidal positions (restarting at 0 in every chunk), keep each chunk's valid frames
      -> encoder layers, attention inside one chunk (n_window tokens)
      -> average pool pairs of frames of each audio (an odd last frame is dropped)
      -> ln_post -> proj -> (num_audio_tokens, output_dim)

The layers are Qwen3-Omni's (qwen3_omni/audio_encoder.py) without the k_proj bias; what
differs is the 1-D convolutions, the one-chunk attention and the pooling.
`audio_bos_eos_token` is in the checkpoint but unused by the reference's forward: loaded, not used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.qwen3_omni.audio_encoder import (AudioEncoderLayer, AudioSizes,
                                                        build_component, checked_feature_lens,
                                                        chunk_lengths,
                                                        read_thinker_config, sinusoids)


@dataclass(frozen=True, slots=True)
class Qwen2_5OmniAudioEncoderConfig(AudioSizes):
    n_window: int = 100                 # a chunk (and an attention window) is 2 * n_window frames
    max_source_positions: int = 1500


def output_lengths(feature_lens: Tensor) -> Tensor:
    """Audio tokens for `feature_lens` mel frames (HF's `_get_feat_extract_output_lengths`):
    the stride-2 conv halves them (rounding up), the pooling halves them again (rounding down)."""
    after_conv = (feature_lens - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


class Qwen2_5OmniAudioEncoder(nn.Module):
    """`forward(input_features (num_mel, total_frames), feature_lens (num_audios,))
    -> (sum of output_lengths(feature_lens), output_dim)`, the audios' tokens in order."""

    def __init__(self, cfg: Qwen2_5OmniAudioEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        self.audio_bos_eos_token = nn.Embedding(2, cfg.output_dim)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg, k_bias=False)
                                    for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.output_dim)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Qwen2_5OmniAudioEncoder:
        """Load `thinker.audio_tower.*` of a Qwen2.5-Omni checkpoint folder (strict)."""
        cfg = Qwen2_5OmniAudioEncoderConfig.from_hf(
            read_thinker_config(Path(path)).audio_config)
        return build_component(cls, cfg, Path(path), "thinker.audio_tower.", device, dtype)

    def forward(self, input_features: Tensor, feature_lens: Tensor) -> Tensor:
        cfg = self.cfg       # two frames at least: one token after the conv and the pooling
        lens = checked_feature_lens(input_features, feature_lens, cfg.num_mel_bins, min_frames=2)
        chunk_lens = chunk_lengths(lens, cfg.chunk_frames)
        chunks = input_features.to(self.conv1.weight.dtype).T.split(chunk_lens)  # (n_i, mel)
        padded = nn.utils.rnn.pad_sequence(chunks, batch_first=True).transpose(1, 2)  # (C, mel, T)
        lens_t = torch.tensor(chunk_lens, device=padded.device)
        frame_mask = torch.arange(padded.shape[2], device=padded.device)[None] < lens_t[:, None]
        h = F.gelu(self.conv1(padded)) * frame_mask[:, None, :]
        h = F.gelu(self.conv2(h)).transpose(1, 2)                        # (C, T', d_model)
        h = h + sinusoids(h.shape[1], cfg.d_model).to(h)
        tokens = (lens_t - 1) // 2 + 1                                   # per chunk
        x = h[torch.arange(h.shape[1], device=h.device)[None] < tokens[:, None]]   # (N, d)
        cu_seqlens = [0, *torch.cumsum(tokens, 0).tolist()]              # a chunk a window
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return self.proj(self.ln_post(self._pool(x, feature_lens)))      # (M, output_dim)

    @staticmethod
    def _pool(x: Tensor, feature_lens: Tensor) -> Tensor:
        """Mean of frame pairs (2i, 2i+1) within each audio; an odd last frame is dropped."""
        after_conv = ((feature_lens - 1) // 2 + 1).tolist()
        pieces, start = [], 0
        for n in after_conv:
            pairs = x[start:start + n - n % 2].view(-1, 2, x.shape[-1])
            pieces.append(pairs.mean(1))
            start += n
        return torch.cat(pieces)
