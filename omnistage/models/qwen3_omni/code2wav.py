"""Qwen3-Omni code2wav: codec frames -> 24 kHz waveform, whole, chunked, or streamed.

HF's `Qwen3OmniMoeCode2Wav` in plain PyTorch; module names follow the checkpoint's
`code2wav.*` tensors one-to-one (q/k/v and gate/up are fused on load), numerics follow
`modeling_qwen3_omni_moe.py` op for op.

    codes (B, Q, T) ─ embed(code + q * codebook_size), mean over Q ─> (B, T, hidden)
      ─ pre-transformer: sliding-window causal attention + SwiGLU, layer-scaled residuals
      ─ upsample: per ratio, causal transposed conv (k = s = ratio) + causal ConvNeXt block
      ─ decoder: causal conv -> per rate, SnakeBeta + causal transposed conv (k = 2s) + three
        dilated residual units -> SnakeBeta -> causal conv to 1 channel -> clamp to [-1, 1]
      ─> wav (B, 1, T * total_upsample - num_lost)

Every layer is causal except the decoder's transposed convs (k = 2s), which trim `k - s`
samples on both sides: each output sample then mixes its own input step with the next one,
and the last `s` samples (which the missing next step would complete) are dropped. So each
decode of T frames yields `num_samples(T)` = T * total_upsample - num_lost samples, and
samples never depend on frames to their right beyond what the trimming keeps. Two
consequences used below:

- Chunked decode (HF's `chunked_decode`, used by `generate(return_audio=True)` with chunk 300,
  left context 25) decodes `| ctx | chunk |` windows and keeps the chunk's samples:

      frames   | chunk 0      | chunk 1      | chunk 2 |
      window 1        | ctx   | chunk 1      |            ctx = min(left_context, start)
      samples  keep wav[ctx * total_upsample : num_samples(ctx + n)]

- Right padding is harmless: a window padded on the right with any codes gives the same first
  `num_samples(n)` samples, so windows of different lengths batch into one forward
  (`vocode_windows`), e.g. one request's first chunk (no context) with others' later ones.

HF's chunked decode keeps `num_samples(ctx + n) - ctx * U` samples of each window, so every
chunk boundary drops `num_lost` samples (555 at 24 kHz) and shifts all audio after it;
`generate(return_audio=True)` only avoids that by decoding up to 300 frames (24 s) in one
window. `Code2WavStream` (code2wav_stream.py), the per-request state of the serving stage,
streams exactly: the transformer continues from kept keys and values, each vocoder window's
last `num_lost` samples are held back and recomputed by the next window, and the
concatenated output is the whole decode.
"""


from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor, nn
from transformers import AutoConfig

from omnistage.models.loader import load_component
from omnistage.models.qwen3_omni.code2wav_config import (CHECKPOINT_PREFIX, Code2WavConfig,
                                                         check_chunking)
from omnistage.models.qwen3_omni.code2wav_transformer import (Code2WavAttention, Code2WavMLP,
                                                              Code2WavTransformer,
                                                              Code2WavTransformerLayer,
                                                              LayerScale)
from omnistage.models.qwen3_omni.code2wav_vocoder import (CausalConv1d, CausalConvTranspose1d,
                                                          ConvNeXtBlock, DecoderBlock,
                                                          DecoderResidualUnit, SnakeBeta,
                                                          vocoder_layers)

# the parts live in code2wav_config / _transformer / _vocoder; importable from here as before
__all__ = ["CHECKPOINT_PREFIX", "CausalConv1d", "CausalConvTranspose1d", "Code2Wav",
           "Code2WavAttention", "Code2WavConfig", "Code2WavMLP", "Code2WavTransformer",
           "Code2WavTransformerLayer", "ConvNeXtBlock", "DecoderBlock", "DecoderResidualUnit",
           "LayerScale", "SnakeBeta", "check_chunking", "vocoder_layers"]


class Code2Wav(nn.Module):
    # checkpoint name -> (our fused parameter, shard id); read by the weight loader
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    # frames of codes before a chunk that its embedding reaches back to (Qwen3-TTS: a causal
    # conv), which a stream keeps; code -1 stands for "before the start" (zero padding)
    embed_context = 0
    trim_left = True                 # the transposed convs' trim (CausalConvTranspose1d)

    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.total_upsample = cfg.total_upsample
        self.build_embedding(cfg)
        self.pre_transformer = self.build_transformer(cfg)
        self.upsample, self.decoder = vocoder_layers(cfg, self.row_size, self.trim_left)

    def build_embedding(self, cfg: Code2WavConfig) -> None:
        h = cfg.hidden_size
        num_codes = cfg.codebook_size * cfg.num_quantizers
        self.code_embedding = nn.Embedding(num_codes, h, _weight=torch.empty(num_codes, h))

    def build_transformer(self, cfg: Code2WavConfig) -> Code2WavTransformer:
        return Code2WavTransformer(cfg)

    @property
    def row_size(self) -> int:
        """Width of the pre-transformer's output rows, which the vocoder takes."""
        return self.cfg.hidden_size

    @property
    def device(self) -> torch.device:
        return self.decoder[-1].conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder[-1].conv.weight.dtype

    @property
    def num_lost(self) -> int:
        """Samples a decode yields fewer than frames * total_upsample."""
        return self.total_upsample - self.cfg.num_samples(1)

    def forward(self, codes: Tensor) -> Tensor:
        """Unchecked decode: codes (B, Q, T) -> wav (B, 1, num_samples(T))."""
        return self.vocode(self.pre_transformer(self.embed(codes)))

    def continue_rows(self, codes: Tensor, past: Tensor, num_past: Tensor, num_new: Tensor
                      ) -> tuple[Tensor, Tensor]:
        """Streams' pre-transformer continued over new frames: codes (B, Q, embed_context + N)
        (the frames the embedding reaches back to, then the N new ones, right-padded) ->
        `Code2WavTransformer.forward_cached`'s rows (B, N, row_size) and caches."""
        return self.pre_transformer.forward_cached(self.embed(codes)[:, self.embed_context:],
                                                   past, num_past, num_new)

    def embed(self, codes: Tensor) -> Tensor:
        """codes (B, Q, T) -> (B, T, hidden): each frame's codebook embeddings averaged."""
        cfg = self.cfg
        offsets = torch.arange(cfg.num_quantizers, device=codes.device) * cfg.codebook_size
        return self.code_embedding(codes + offsets[:, None]).mean(1)  # (B, Q, T, hid) -> mean

    def vocode(self, h: Tensor) -> Tensor:
        """The convolutional part: pre-transformer rows (B, T, hidden) -> wav (B, 1,
        num_samples(T)), clamped to [-1, 1]."""
        h = h.transpose(1, 2)                                     # (B, hidden, T)
        for up_conv, convnext in self.upsample:
            h = convnext(up_conv(h))                              # (B, hidden, T * ratio)
        for layer in self.decoder:
            h = layer(h)                                          # ... -> (B, 1, num_samples(T))
        return h.clamp(-1.0, 1.0)

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """codes (B, num_quantizers, T) -> wav (B, 1, T * total_upsample - num_lost), as HF's
        `code2wav(codes)`."""
        self.check_codes(codes, "codes", batched=True)
        return self(codes.to(self.device))

    @torch.inference_mode()
    def chunked_decode(self, codes: Tensor, chunk_size: int = 300, left_context_size: int = 25
                       ) -> Tensor:
        """As HF's `chunked_decode`: windows of `chunk_size` frames, each decoded with up to
        `left_context_size` earlier frames, context samples dropped; (B, 1, samples)."""
        self.check_codes(codes, "codes", batched=True)
        check_chunking(self.cfg, chunk_size, left_context_size)
        codes = codes.to(self.device)
        wavs = []
        for start in range(0, codes.shape[-1], chunk_size):
            ctx = min(left_context_size, start)
            wav = self(codes[..., start - ctx:start + chunk_size])
            wavs.append(wav[..., ctx * self.total_upsample:])
        return torch.cat(wavs, dim=-1)

    @torch.inference_mode()
    def vocode_windows(self, windows: Sequence[tuple[Tensor, int]],
                       shape: tuple[int, int] | None = None,
                       vocode: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
        """Vocode windows `(rows (n, hidden), skip)` of pre-transformer output, of any
        lengths, in one forward, right-padded to the longest, or to `shape` (windows, frames)
        if given and larger; each returns its samples `[skip, num_samples(n))` in float32.

        Padding is exact: every layer is causal but the decoder blocks' transposed convs,
        whose one-step lookahead reaches only samples past `num_samples(n)` (the last kept
        output of k = 2s trimmed by s draws on inputs up to the last real one), so the kept
        samples never see a padded row; padded windows are zeros, computed and dropped.
        vocode: what runs `self.vocode` (CUDA graphs of it, `VocoderGraphs`)."""
        if not windows:
            return []
        lengths = [rows.shape[0] for rows, _ in windows]
        num, longest = shape or (0, 0)
        batch = self.decoder[-1].conv.weight.new_zeros(max(num, len(windows)),
                                                       max(longest, *lengths), self.row_size)
        for i, (rows, _) in enumerate(windows):
            batch[i, :lengths[i]] = rows
        wav = (vocode or self.vocode)(batch)[:, 0].float()        # (B, num_samples(max_len))
        return [wav[i, skip:self.cfg.num_samples(n)]
                for i, ((_, skip), n) in enumerate(zip(windows, lengths))]

    def check_codes(self, codes: Tensor, name: str, batched: bool) -> None:
        """Raise ValueError unless `codes` is an integer (B,) Q, T tensor of valid codes."""
        shape = "(B, num_quantizers, T)" if batched else "(num_quantizers, T)"
        q = self.cfg.num_quantizers
        if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got {codes.dtype}")
        if codes.ndim != (3 if batched else 2) or codes.shape[-2] != q:
            raise ValueError(f"{name}: expected shape {shape} with num_quantizers={q}, "
                             f"got {tuple(codes.shape)}")
        if batched and codes.shape[-1] == 0:
            raise ValueError(f"{name}: no frames (T = 0)")
        if batched and codes.shape[-1] > self.cfg.max_position_embeddings:
            raise ValueError(f"{name}: {codes.shape[-1]} frames exceed max_position_embeddings "
                             f"{self.cfg.max_position_embeddings} of one decode; use "
                             "chunked_decode")
        size = self.cfg.codebook_size
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= size):
            raise ValueError(f"{name}: codes must lie in [0, codebook_size={size}), got values "
                             f"in [{int(codes.min())}, {int(codes.max())}]")

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None, prefix: str = CHECKPOINT_PREFIX
                        ) -> Code2Wav:
        """Build from a Qwen3-Omni checkpoint folder (config.json + safetensors, single or
        sharded), loading only the tensors named `prefix*`, in `dtype` (None: the
        checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model folder)")
        return cls.load(path, Code2WavConfig.from_hf(AutoConfig.from_pretrained(path)), prefix,
                        device, dtype)

    @classmethod
    def load(cls, path: Path, cfg: Code2WavConfig, prefix: str, device: torch.device | str,
             dtype: torch.dtype | None, exclude: tuple[str, ...] = ()) -> Code2Wav:
        """`cls(cfg)` with the checkpoint's `prefix*` tensors (less `exclude`), strictly."""
        model = load_component(lambda: cls(cfg), path, prefix, device, dtype,
                               cls.packed_modules, exclude)
        return model.requires_grad_(False)
