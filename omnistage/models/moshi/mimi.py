"""Mimi, Kyutai's streaming speech codec (transformers' `MimiModel`), on our layers:

    encode:  wav (B, 1, N) 24 kHz ─ SEANet encoder (causal convs, strided by the ratios)
             ─ transformer (sliding-window causal) ─ downsample (stride 2, replicate pad)
             ─ split RVQ: codebook 0 semantic, 1.. acoustic (nearest vector, residual)
             ─> codes (B, K, ceil(N / frame_size)), 12.5 Hz for the released codec
    decode:  codes (B, K, T) ─ RVQ sums, 1x1 output projections ─ upsample (transposed, x2)
             ─ transformer ─ SEANet decoder (transposed convs by the ratios)
             ─> (B, 1, T * frame_size)

`decode_step(codes, state)` decodes a few frames more of one stream, `encode_step(wav, k,
state)` encodes a few whole frames more: the same numbers as one whole `decode` / `encode` of
everything so far (every layer is causal, and each keeps what its next call needs in `state`,
see mimi_layers.py). `new_decode_state()` / `new_encode_state()` start a stream.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.loader import load_component
from omnistage.models.moshi.config import MimiConfig
from omnistage.models.moshi.mimi_layers import (MimiTransformer, SEANetDecoder, SEANetEncoder,
                                                State, StreamConv, StreamConvTranspose)


class EuclideanCodebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embed_sum = nn.Parameter(torch.zeros(size, dim))

    def vectors(self) -> Tensor:                                  # (size, dim)
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class CodebookSlot(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.codebook = EuclideanCodebook(size, dim)


class ResidualVQ(nn.Module):
    def __init__(self, cfg: MimiConfig, num: int) -> None:
        super().__init__()
        self.input_proj = nn.Conv1d(cfg.hidden_size, cfg.codebook_dim, 1, bias=False)
        self.output_proj = nn.Conv1d(cfg.codebook_dim, cfg.hidden_size, 1, bias=False)
        self.layers = nn.ModuleList(CodebookSlot(cfg.codebook_size, cfg.codebook_dim)
                                    for _ in range(num))

    def encode(self, x: Tensor, num: int) -> Tensor:              # (B, H, T) -> (B, num, T)
        residual = self.input_proj(x)
        codes = []
        for layer in self.layers[:num]:
            vectors = layer.codebook.vectors()
            flat = residual.transpose(1, 2).reshape(-1, residual.shape[1])
            code = torch.cdist(flat[None].float(), vectors[None].float(), p=2)[0].argmin(-1)
            code = code.view(x.shape[0], x.shape[2])
            residual = residual - F.embedding(code, vectors).transpose(1, 2)
            codes.append(code)
        return torch.stack(codes, dim=1)

    def decode(self, codes: Tensor) -> Tensor:                    # (B, k, T) -> (B, H, T)
        total = sum(F.embedding(codes[:, i], layer.codebook.vectors())
                    for i, layer in enumerate(self.layers[:codes.shape[1]]))
        return self.output_proj(total.transpose(1, 2))


class SplitResidualVQ(nn.Module):
    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        self.num_semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualVQ(cfg, self.num_semantic)
        self.acoustic_residual_vector_quantizer = ResidualVQ(
            cfg, cfg.num_quantizers - self.num_semantic)

    def encode(self, x: Tensor, num: int) -> Tensor:
        codes = self.semantic_residual_vector_quantizer.encode(x, self.num_semantic)
        if num > self.num_semantic:
            acoustic = self.acoustic_residual_vector_quantizer.encode(x, num - self.num_semantic)
            codes = torch.cat([codes, acoustic], dim=1)
        return codes

    def decode(self, codes: Tensor) -> Tensor:
        out = self.semantic_residual_vector_quantizer.decode(codes[:, :self.num_semantic])
        if codes.shape[1] > self.num_semantic:
            out = out + self.acoustic_residual_vector_quantizer.decode(
                codes[:, self.num_semantic:])
        return out


class MimiModel(nn.Module):
    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = SEANetEncoder(cfg)
        self.encoder_transformer = MimiTransformer(cfg)
        self.downsample = StreamConv(cfg.hidden_size, cfg.hidden_size, 4, stride=2, bias=False,
                                     mode="replicate")
        self.quantizer = SplitResidualVQ(cfg)
        self.upsample = StreamConvTranspose(cfg.hidden_size, cfg.hidden_size, 4, 2,
                                            groups=cfg.upsample_groups, bias=False)
        self.decoder_transformer = MimiTransformer(cfg)
        self.decoder = SEANetDecoder(cfg)

    @torch.inference_mode()
    def encode_step(self, wav: Tensor, num_quantizers: int | None, state: State | None
                    ) -> Tensor:
        """(B, 1, N) -> codes (B, K, ceil(N / frame_size)); K: num_quantizers or all. With a
        state, N is whole frames and they continue the stream."""
        num = num_quantizers or self.cfg.num_quantizers
        if not self.cfg.num_semantic_quantizers <= num <= self.cfg.num_quantizers:
            raise ValueError(f"num_quantizers {num}: between {self.cfg.num_semantic_quantizers} "
                             f"and {self.cfg.num_quantizers}")
        if state is not None and wav.shape[-1] % self.cfg.frame_size:
            raise ValueError(f"audio of {wav.shape[-1]} samples: a stream takes whole frames "
                             f"of {self.cfg.frame_size}")
        h = self.encoder(wav, state)                                       # (B, H, L)
        h = self.encoder_transformer(h.transpose(1, 2), state).transpose(1, 2)
        return self.quantizer.encode(self.downsample(h, state), num)

    def encode(self, wav: Tensor, num_quantizers: int | None = None) -> Tensor:
        """Whole clip: (B, 1, N) -> codes (B, K, ceil(N / frame_size))."""
        return self.encode_step(wav, num_quantizers, None)

    def new_encode_state(self) -> State:
        return {}

    def new_decode_state(self) -> State:
        return {}

    @torch.inference_mode()
    def decode_step(self, codes: Tensor, state: State | None) -> Tensor:
        """codes (B, K, T) -> (B, 1, T * frame_size); with a state, the frames continue it."""
        h = self.upsample(self.quantizer.decode(codes), state)             # (B, H, 2T)
        h = self.decoder_transformer(h.transpose(1, 2), state).transpose(1, 2)
        return self.decoder(h, state)

    def decode(self, codes: Tensor) -> Tensor:
        """Whole clip: codes (B, K, T) -> (B, 1, T * frame_size)."""
        return self.decode_step(codes, None)

    @classmethod
    def from_pretrained(cls, path: str | Path, prefix: str = "", cfg: MimiConfig | None = None,
                        device: torch.device | str = "cpu", dtype: torch.dtype | None = None
                        ) -> MimiModel:
        """A MimiModel folder (prefix ""), or the codec inside a Moshi folder
        (prefix "audio_encoder.", cfg from its config); strictly, the `initialized` flags aside."""
        cfg = cfg or MimiConfig.from_pretrained(path)
        model = load_component(lambda: cls(cfg), Path(path), prefix, device, dtype, {},
                               ignore_suffixes=(".initialized",))
        return model.requires_grad_(False)
