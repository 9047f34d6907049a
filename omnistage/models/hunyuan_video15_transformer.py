"""HunyuanVideo-1.5 transformer: diffusers' `HunyuanVideo15Transformer3DModel` in plain PyTorch.

Module and parameter names follow diffusers, so a diffusers `transformer/` folder loads by
name; numerics follow `diffusers/models/transformers/transformer_hunyuan_video15.py`.

    latents (B, C, F, H, W), C = [noisy z | condition z | first-frame mask 1]
        -> x_embedder (Conv3d, stride = patch) -> x (B, N, D), N = F'H'W'
    timestep (B,) -> sinusoid -> time_embed -> temb (B, D)   (+ timestep_r's: MeanFlow)
    context, three streams, each + its cond_type_embed row:
        Qwen2.5-VL states (B, L1, text_dim) -> context_embedder (token refiner)       type 0
        byT5 glyph states (B, L2, text_2_dim) -> context_embedder_2                    type 1
        SigLIP image tokens (B, I, image_dim) -> image_embedder  (image-to-video)      type 2
    num_layers x dual-stream block (AdaLN-Zero on video and context), joint attention over
        [video | context] with 3D rope on the video tokens, masked context keys left out
    norm_out (AdaLN continuous) -> proj_out -> unpatchify (B, out_channels, F, H, W)

Where diffusers pads every stream to its full length (1000 Qwen tokens, 256 byT5 tokens, 729
image tokens, all attended as masked keys by every block), each stream here keeps the tokens
of its mask, valid first, cut to the longest row's count (`compact`), and text-to-video has
no image stream at all (diffusers: all-zero image embeds, all masked). Masked keys weigh
nothing and the context has no position, so the valid tokens' results are the same.

Sparse / sliding-tile attention (the upstream repository's SSTA for 720p) is not part of
diffusers' config: a config that asks for an attention mode is refused (`config_from_dict`).

Several ranks, from the stage's groups current at construction:
  sequence par.  the video and the context tokens split over the Ulysses x ring ranks (both
                 segments of the joint attention, through SequenceSplit.attend; rope sliced
                 with the video tokens), the video output gathered whole; the refiner and
                 embedders run whole on every rank. Heads must divide by ulysses x tp.
  tensor par.    q/k/v column-parallel (this rank's heads), out projections row-parallel, the
                 FFNs column / row, the AdaLN projections split by output and gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.layers.dit import AdaLayerNormContinuous
from omnistage.layers.sequence_parallel import SequenceRanks, SequenceSplit, check_heads
from omnistage.layers.step_cache import CacheGroup, run_cached
from omnistage.models.diffusers_loader import build_from_folder, config_from_dict, read_config
from omnistage.models.hunyuan_video15_transformer_layers import (
    HunyuanVideo15ByT5TextProjection, HunyuanVideo15ImageProjection, HunyuanVideo15TimeEmbedding,
    HunyuanVideo15TokenRefiner, HunyuanVideo15TransformerBlock, hunyuan_rope)

IDENTITY = (1.0, 0.0)       # step caching: the first block's modulated input, change as is
BYT5_HIDDEN = 2048          # diffusers' fixed width of the glyph projection's MLP


@dataclass(frozen=True, slots=True)
class HunyuanVideo15TransformerConfig:
    in_channels: int = 65
    out_channels: int = 32
    num_attention_heads: int = 16
    attention_head_dim: int = 128
    num_layers: int = 54
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 1
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    text_embed_dim: int = 3584
    text_embed_2_dim: int = 1472
    image_embed_dim: int = 1152
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, ...] = (16, 56, 56)
    target_size: int = 640          # the pipelines' default resolution bucket, in pixels
    task_type: str = "i2v"
    use_meanflow: bool = False

    def __post_init__(self) -> None:
        if self.qk_norm != "rms_norm":
            raise ValueError(f"qk_norm {self.qk_norm!r}: only 'rms_norm' is built")
        if len(self.rope_axes_dim) != 3 or sum(self.rope_axes_dim) != self.attention_head_dim:
            raise ValueError(f"rope_axes_dim {self.rope_axes_dim} must be three widths adding "
                             f"up to attention_head_dim ({self.attention_head_dim})")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch(self) -> tuple[int, int, int]:
        return self.patch_size_t, self.patch_size, self.patch_size

    @classmethod
    def from_dict(cls, raw: dict) -> HunyuanVideo15TransformerConfig:
        return config_from_dict(cls, raw, "HunyuanVideo15Transformer3DModel")


def compact(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The tokens of x (B, L, D) where mask (B, L) holds, valid first in their order, cut to
    the longest row's count: -> (B, L', D), mask (B, L') bool. One host sync (L')."""
    mask = mask.bool()
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)         # valid first
    keep = max(int(mask.sum(1).max()), 1)
    order = order[:, :keep]
    return x.gather(1, order[..., None].expand(-1, -1, x.shape[-1])), mask.gather(1, order)


class HunyuanVideo15Transformer3DModel(nn.Module):
    # FP8 (layers/fp8.py): the embedders and the final projection stay in bf16
    fp8_keep = ("context_embedder.*", "context_embedder_2.*", "image_embedder.*",
                "time_embed.*", "proj_out")

    def __init__(self, cfg: HunyuanVideo15TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim, heads = cfg.inner_dim, cfg.num_attention_heads
        check_heads(heads)
        self.seq_ranks = SequenceRanks.current()
        self.x_embedder = nn.Module()
        self.x_embedder.proj = nn.Conv3d(cfg.in_channels, dim, kernel_size=cfg.patch,
                                         stride=cfg.patch)
        self.image_embedder = HunyuanVideo15ImageProjection(cfg.image_embed_dim, dim)
        self.context_embedder = HunyuanVideo15TokenRefiner(cfg.text_embed_dim, dim, heads,
                                                           cfg.num_refiner_layers)
        self.context_embedder_2 = HunyuanVideo15ByT5TextProjection(cfg.text_embed_2_dim,
                                                                   BYT5_HIDDEN, dim)
        self.time_embed = HunyuanVideo15TimeEmbedding(dim, cfg.use_meanflow)
        self.cond_type_embed = nn.Embedding(3, dim)
        self.transformer_blocks = nn.ModuleList([
            HunyuanVideo15TransformerBlock(dim, heads, cfg.attention_head_dim, cfg.mlp_ratio)
            for _ in range(cfg.num_layers)])
        self.norm_out = AdaLayerNormContinuous(dim)
        self.proj_out = nn.Linear(dim, math.prod(cfg.patch) * cfg.out_channels)

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                encoder_attention_mask: Tensor, encoder_hidden_states_2: Tensor,
                encoder_attention_mask_2: Tensor, image_embeds: Tensor | None = None,
                timestep_r: Tensor | None = None,
                step_cache: list[CacheGroup] | None = None) -> Tensor:
        """hidden_states (B, in_channels, F, H, W); timestep (B,) in the latents' dtype; Qwen
        states (B, L1, text_dim) with mask (B, L1); byT5 states (B, L2, text_2_dim) with mask
        (B, L2); image_embeds (B, I, image_dim) SigLIP tokens, None for text-to-video.
        Returns (B, out_channels, F, H, W). `step_cache`: per request and branch, skip the
        blocks on steps whose first modulated input barely moved; None runs every block."""
        grid = self._grid(hidden_states.shape)
        temb = self.time_embed(timestep, timestep_r)                             # (B, D)
        ctx, ctx_mask = self._context(timestep, encoder_hidden_states, encoder_attention_mask,
                                      encoder_hidden_states_2, encoder_attention_mask_2,
                                      image_embeds)                              # (B, L, D)
        seq = SequenceSplit.split([math.prod(grid), ctx.shape[1]], [None, ctx_mask],
                                  self.seq_ranks)
        x = self.x_embedder.proj(hidden_states).flatten(2).transpose(1, 2)       # (B, N, D)
        x, ctx = seq.local(x, 0).contiguous(), seq.local(ctx, 1).contiguous()
        cos, sin = hunyuan_rope(grid, self.cfg.rope_axes_dim, self.cfg.rope_theta, x.device)
        rope = seq.local(cos, 0, dim=0), seq.local(sin, 0, dim=0)

        def run_blocks(idx: Tensor | None) -> Tensor:
            h, c, t, s = x, ctx, temb, seq
            if idx is not None:
                h, c, t, s = x[idx], ctx[idx], temb[idx], seq.rows(idx)
            for block in self.transformer_blocks:
                h, c = block(h, c, t, s, rope)
            return h                                                             # (b, N, D)

        if step_cache is None:
            x = run_blocks(None)
        else:
            indicator = self.transformer_blocks[0].modulated_input(x, temb)
            x = run_cached(x, indicator, step_cache, IDENTITY, run_blocks)
        x = self.proj_out(self.norm_out(x, temb))
        return self._unpatchify(seq.gather(x, 0), grid)

    def _context(self, timestep: Tensor, text: Tensor, text_mask: Tensor, glyph: Tensor,
                 glyph_mask: Tensor, image: Tensor | None) -> tuple[Tensor, Tensor]:
        """The context tokens [image, byT5, Qwen] embedded, each stream compacted (module
        docstring): -> (B, L, D), key mask (B, L) bool."""
        types = self.cond_type_embed.weight
        text, text_mask = compact(text, text_mask)
        parts = [self.context_embedder(text, timestep, text_mask) + types[0]]
        masks = [text_mask]
        glyph, glyph_mask = compact(glyph, glyph_mask)
        parts.insert(0, self.context_embedder_2(glyph) + types[1])
        masks.insert(0, glyph_mask)
        if image is not None:
            if image.shape[0] != text.shape[0] or image.dim() != 3:
                raise ValueError(f"image_embeds must be (batch, tokens, "
                                 f"{self.cfg.image_embed_dim}), got {tuple(image.shape)}")
            parts.insert(0, self.image_embedder(image) + types[2])
            masks.insert(0, torch.ones(image.shape[:2], dtype=torch.bool, device=image.device))
        return torch.cat(parts, dim=1), torch.cat(masks, dim=1)

    def _grid(self, shape: torch.Size) -> tuple[int, int, int]:
        """(F', H', W'): the token grid of latents (B, C, F, H, W), which the patch divides."""
        if len(shape) != 5 or shape[1] != self.cfg.in_channels:
            raise ValueError(f"hidden_states must be (batch, {self.cfg.in_channels}, frames, "
                             f"height, width), got {tuple(shape)}")
        if any(n % p for n, p in zip(shape[2:], self.cfg.patch)):
            raise ValueError(f"latent frames, height, width {tuple(shape[2:])} must be "
                             f"multiples of the patch {self.cfg.patch}")
        return tuple(n // p for n, p in zip(shape[2:], self.cfg.patch))

    def _unpatchify(self, out: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """(B, F'H'W', pt*ph*pw*C) -> (B, C, F'pt, H'ph, W'pw): diffusers' channel-first
        layout of each token's features (C, pt, ph, pw)."""
        pt, ph, pw = self.cfg.patch
        out = out.reshape(out.shape[0], *grid, -1, pt, ph, pw)     # (B, F', H', W', C, pt, ph, pw)
        return out.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> HunyuanVideo15Transformer3DModel:
        """Build from a diffusers folder (config.json + safetensors, maybe sharded) in `dtype`
        (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        return build_from_folder(cls, HunyuanVideo15TransformerConfig.from_dict(
            read_config(path)), path, device, dtype)
