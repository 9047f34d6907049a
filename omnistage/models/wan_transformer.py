"""Wan transformer: diffusers' `WanTransformer3DModel` (Wan2.1, Wan2.2) in plain PyTorch.

Module and parameter names follow diffusers, so a diffusers `transformer/` folder loads by
name (`WanTransformer3DModel.from_pretrained`); numerics follow
`diffusers/models/transformers/transformer_wan.py` op for op.

    video (B,C,F,H,W) -> patch_embedding (Conv3d, stride = patch) -> x (B,N,D), N = F'H'W'
    timestep (B,) or (B,N) -> sinusoid -> time_embedder -> temb (D) -> time_proj (6D), once per
                              distinct value, picked per row / token (TimeEmbedding)
    text (B,L,text_dim) -> text_embedder;  CLIP image (B,I,image_dim) -> image_embedder
    num_layers x WanTransformerBlock, shift/scale/gate = scale_shift_table + time_proj:
        x += gate   * self_attn(norm1(x) * (1 + scale) + shift)     3D rope, all N tokens
        x +=          cross_attn(norm2(x), text [, image])          no modulation
        x += c_gate * ffn(norm3(x) * (1 + c_scale) + c_shift)
    norm_out (shift, scale from its own table + temb) -> proj_out -> unpatchify (B,C',F,H,W)

The variants differ by config only. Wan2.1 T2V: text cross-attention. Wan2.1 I2V (`image_dim`,
`added_kv_proj_dim`): the cross-attention's queries also attend to the CLIP image tokens,
with their own keys/values and softmax, and the two results add up (FLF2V's
`pos_embed_seq_len`: first and last frame's tokens, with a learnt position table). Wan2.2
A14B: two such models, one per expert, nothing special here. Wan2.2 TI2V-5B: 48 channels and
a timestep per token (the pipeline's `expand_timesteps`: with an input image, the first
latent frame's tokens get t = 0), so the modulation is per token. Those timesteps take a
few values only (t, and 0), so the embeddings are computed once per value and each token
picks its own: diffusers embeds every token, and keeps a (B, N, 6D) modulation input alive
through all blocks.

Unlike diffusers, the image tokens stay their own argument all the way down instead of being
split off the front of the context by a hard-coded text length of 512; the text keys are
not masked (Wan's pipeline pads captions with zeros to 512 and attends to the padding).
D = num_attention_heads * attention_head_dim; the q/k RMSNorms span all heads ("across
heads"), whatever `qk_norm` says, as in diffusers.

Several ranks (issue 18), from the stage's groups current at construction:
  tensor parallel  q/k/v and the image keys/values column-parallel (this rank's heads), the
                   across-heads RMSNorms summing squares over the ranks, output projections
                   row-parallel, the FFNs column / row; the rest whole on every rank
  sequence par.    the video tokens split over the Ulysses x ring ranks (self-attention
                   through SequenceSplit.attend), rope tables and per-token timesteps sliced
                   alike; text and image tokens whole on every rank (cross-attention needs
                   no exchange); the output gathered whole. Heads must divide by ulysses x tp.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.layers.dit import norm_modulate
from omnistage.layers.sequence_parallel import SequenceRanks, SequenceSplit, check_heads
from omnistage.layers.step_cache import CacheGroup, run_cached
from omnistage.models.diffusers_loader import build_from_folder, read_config
from omnistage.models.wan_transformer_config import (TEACACHE_I2V_480P, TEACACHE_I2V_720P,
                                                     TEACACHE_T2V, TOKENS_480P, TOKENS_720P,
                                                     WanTransformerConfig, teacache_coefficients)
from omnistage.models.wan_transformer_layers import (FP32LayerNorm, HeadsRMSNorm, Rope,
                                                     TimeEmbedding, WanAttention,
                                                     WanImageEmbedding,
                                                     WanTimeTextImageEmbedding,
                                                     WanTransformerBlock, wan_rope)

# the config and the parts live in wan_transformer_config / _layers; importable from here
__all__ = ["FP32LayerNorm", "HeadsRMSNorm", "Rope", "TEACACHE_I2V_480P", "TEACACHE_I2V_720P",
           "TEACACHE_T2V", "TOKENS_480P", "TOKENS_720P", "TimeEmbedding", "WanAttention",
           "WanImageEmbedding", "WanTimeTextImageEmbedding", "WanTransformer3DModel",
           "WanTransformerBlock", "WanTransformerConfig", "teacache_coefficients", "wan_rope"]
IDENTITY = (1.0, 0.0)


# ---- model ---------------------------------------------------------------------------------

class WanTransformer3DModel(nn.Module):
    # older diffusers saved an unused query norm for the image keys (diffusers skips it too)
    ignored_tensors = ("norm_added_q",)
    # float32 in any dtype, as diffusers' _keep_in_fp32_modules (build_from_folder reads it)
    keep_in_fp32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")
    # FP8 (layers/fp8.py): linears left in bf16, besides those too small: the time, text and
    # image embeddings with the modulation projection (condition_embedder), the final projection
    fp8_keep = ("condition_embedder.*", "proj_out")

    def __init__(self, cfg: WanTransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.inner_dim
        check_heads(cfg.num_attention_heads)
        self.seq_ranks = SequenceRanks.current()
        out_channels = cfg.out_channels or cfg.in_channels
        self.patch_embedding = nn.Conv3d(cfg.in_channels, dim, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size)
        self.condition_embedder = WanTimeTextImageEmbedding(cfg)
        self.blocks = nn.ModuleList([WanTransformerBlock(cfg) for _ in range(cfg.num_layers)])
        self.norm_out = FP32LayerNorm(dim, cfg.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, out_channels * math.prod(cfg.patch_size))
        self.scale_shift_table = nn.Parameter(torch.empty(1, 2, dim))
        # TeaCache's Wan2.1 polynomials apply (teacache_coefficients); a pipeline of another
        # model with a Wan2.1 config (Wan2.2 A14B's experts are 14B T2V-shaped) clears it
        self.published_teacache = True

    def forward(self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                encoder_hidden_states_image: Tensor | None = None,
                step_cache: list[CacheGroup] | None = None) -> Tensor:
        """hidden_states (B, C, F, H, W) latents; timestep (B,), or (B, N) one per token
        (TI2V's expand_timesteps, N = F'H'W' in frame, row, column order); text
        (B, L, text_dim); image (B, I, image_dim) CLIP tokens, for checkpoints with
        image_dim only. Returns (B, out_channels, F, H, W).
        `step_cache`: per request and branch, skip the blocks on steps whose first modulated
        input barely moved (layers/step_cache.py); None runs every block.
        Below, N counts this rank's video tokens (all of them with one sequence-parallel rank)."""
        grid = self._grid(hidden_states.shape)
        seq = SequenceSplit.split([math.prod(grid)], [None], self.seq_ranks)
        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2)       # (B, N, D)
        x = seq.local(x, 0).contiguous()
        time = self.condition_embedder.time(
            self._timesteps(timestep, x.shape[0], seq), encoder_hidden_states.dtype)
        text = self.condition_embedder.text_embedder(encoder_hidden_states)     # (B, L, D)
        image = self._image_tokens(encoder_hidden_states_image)                  # (B, I, D)
        cos, sin = wan_rope(grid, self.cfg.attention_head_dim, self.cfg.rope_max_seq_len,
                            x.device)
        rope = seq.local(cos, 0, dim=0), seq.local(sin, 0, dim=0)

        def run_blocks(idx: Tensor | None) -> Tensor:
            h, t, i, p = x, text, image, time
            if idx is not None:
                h, t, p = x[idx], text[idx], time.rows(idx)
                i = None if image is None else image[idx]
            for block in self.blocks:
                h = block(h, t, i, p, rope, seq)
            return h                                                             # (b, N, D)

        if step_cache is None:
            x = run_blocks(None)
        else:
            indicator, coefficients = self._cache_indicator(x, time, grid)
            x = run_cached(x, indicator, step_cache, coefficients, run_blocks)
        shift, scale = (self.scale_shift_table + time.temb[:, None]).unbind(1)   # (U, D) each
        x = norm_modulate(self.norm_out, x, time.pick(scale), time.pick(shift))
        return self._unpatchify(seq.gather(self.proj_out(x), 0), grid)

    def _cache_indicator(self, x: Tensor, time: TimeEmbedding, grid: tuple[int, int, int]
                         ) -> tuple[Tensor, tuple[float, ...]]:
        """What step caching watches, (B, S, D), and the polynomial that rescales its change:
        TeaCache's on the timestep embedding where published, else the first block's
        modulated input as is (module comment on TEACACHE_T2V)."""
        coefficients = teacache_coefficients(self.cfg, grid) if self.published_teacache \
            else None
        if coefficients is None:
            return self.blocks[0].modulated_input(x, time), IDENTITY
        return time.pick(time.temb), coefficients

    def _grid(self, shape: torch.Size) -> tuple[int, int, int]:
        """(F', H', W'): the token grid of latents (B, C, F, H, W), which the patch divides."""
        if len(shape) != 5 or shape[1] != self.cfg.in_channels:
            raise ValueError(f"hidden_states must be (batch, {self.cfg.in_channels}, frames, "
                             f"height, width), got {tuple(shape)}")
        if any(n % p for n, p in zip(shape[2:], self.cfg.patch_size)):
            raise ValueError(f"latent frames, height, width {tuple(shape[2:])} must be "
                             f"multiples of patch_size {self.cfg.patch_size}")
        return tuple(n // p for n, p in zip(shape[2:], self.cfg.patch_size))

    @staticmethod
    def _timesteps(timestep: Tensor, batch: int, seq: SequenceSplit) -> Tensor:
        """(B,) -> (B, 1); (B, N) per token -> this rank's tokens' (B, N_local)."""
        num_tokens = sum(seq.sizes[0])
        if timestep.shape == (batch,):
            return timestep[:, None]
        if timestep.shape == (batch, num_tokens):
            return seq.local(timestep, 0)
        raise ValueError(f"timestep must be (batch,) or (batch, tokens) = ({batch},) or "
                         f"({batch}, {num_tokens}), got {tuple(timestep.shape)}")

    def _image_tokens(self, image: Tensor | None) -> Tensor | None:
        embedder = self.condition_embedder.image_embedder
        if (image is None) != (embedder is None):
            raise ValueError("encoder_hidden_states_image is required by, and only accepted "
                             "by, checkpoints with image_dim (Wan2.1 I2V / FLF2V); this one has "
                             f"image_dim {self.cfg.image_dim}")
        return None if image is None else embedder(image)

    def _unpatchify(self, out: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """(B, F'H'W', pt*ph*pw*C) -> (B, C, F'pt, H'ph, W'pw), diffusers' layout."""
        pt, ph, pw = self.cfg.patch_size
        out = out.reshape(out.shape[0], *grid, pt, ph, pw, -1)     # (B, F', H', W', pt, ph, pw, C)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> WanTransformer3DModel:
        """Build from a diffusers folder (config.json + safetensors, maybe sharded) in `dtype`
        (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        return build_from_folder(cls, WanTransformerConfig.from_dict(read_config(path)), path,
                                 device, dtype)
