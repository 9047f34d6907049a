"""Stable Diffusion 3 / 3.5 MMDiT: diffusers' `SD3Transformer2DModel` in plain PyTorch.

Module and parameter names follow diffusers, so a pipeline's `transformer/` folder loads by
name (`SD3Transformer2DModel.from_pretrained`); numerics follow
`diffusers/models/transformers/transformer_sd3.py` and its `JointTransformerBlock` op for op.

    latents (B,C,h,w) -> pos_embed: 2x2 conv patches + 2-D sincos table cropped from the
                         centre of a pos_embed_max_size^2 grid -> img (B,N,D)
    t (0..1000), pooled (B,P) -> time_text_embed -> temb (B,D)
    text (B,T,joint) -> context_embedder -> txt (B,T,D)
    num_layers x SD3JointTransformerBlock: two streams, joint attention over [img, txt];
        3.5-medium's `dual_attention_layers` add a second, image-only attention (attn2);
        3.5's qk_norm "rms_norm" normalises q and k per head;
        the last block is `context_pre_only`: its text stream ends after the attention
    norm_out (AdaLayerNormContinuous) -> proj_out -> unpatchify -> (B,C,h,w)

D = num_attention_heads * attention_head_dim (= caption_projection_dim). `skip_layers`
(diffusers' skip-layer guidance) runs the forward without the named blocks. One rank: no tensor
or sequence parallelism here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.dit import (AdaLayerNormContinuous, AdaLayerNormZero, FeedForward,
                                  TimestepEmbedding, timestep_embedding)
from omnistage.layers.norm import RMSNorm
from omnistage.layers.sequence_parallel import sdpa
from omnistage.models.diffusers_loader import build_from_folder, config_from_dict, read_config

QK_NORMS = (None, "rms_norm")     # 3.0: none; 3.5: rms_norm


@dataclass(frozen=True, slots=True)
class SD3TransformerConfig:
    sample_size: int = 128
    patch_size: int = 2
    in_channels: int = 16
    num_layers: int = 18
    attention_head_dim: int = 64
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096
    caption_projection_dim: int = 1152
    pooled_projection_dim: int = 2048
    out_channels: int | None = 16      # None: in_channels
    pos_embed_max_size: int = 96
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm {self.qk_norm!r}: supported are {QK_NORMS}")
        if self.caption_projection_dim != self.inner_dim:
            raise ValueError(f"caption_projection_dim {self.caption_projection_dim}: the joint "
                             f"blocks need num_attention_heads * attention_head_dim = "
                             f"{self.inner_dim}")
        bad = [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dual_attention_layers {bad}: outside [0, {self.num_layers})")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def num_out_channels(self) -> int:
        return self.in_channels if self.out_channels is None else self.out_channels

    @classmethod
    def from_dict(cls, raw: dict) -> SD3TransformerConfig:
        return config_from_dict(cls, raw, "SD3 transformer")


# ---- embeddings ----------------------------------------------------------------------------

class PatchEmbed(nn.Module):
    """p x p conv patches plus the fixed sincos table of a max_size x max_size grid (stored in
    the checkpoint), cropped from its centre to the latent's patch grid."""

    def __init__(self, in_channels: int, dim: int, patch_size: int, max_size: int) -> None:
        super().__init__()
        self.patch_size, self.max_size = patch_size, max_size
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.empty(1, max_size * max_size, dim),
                                      requires_grad=False)

    def forward(self, latents: Tensor) -> Tensor:
        h, w = (s // self.patch_size for s in latents.shape[-2:])
        if h > self.max_size or w > self.max_size:
            raise ValueError(f"latent grid {h}x{w} patches: the model's positions reach "
                             f"pos_embed_max_size={self.max_size} per side")
        top, left = (self.max_size - h) // 2, (self.max_size - w) // 2
        table = self.pos_embed.view(1, self.max_size, self.max_size, -1)
        pos = table[:, top:top + h, left:left + w].reshape(1, h * w, -1)      # (1, N, D)
        x = self.proj(latents).flatten(2).transpose(1, 2)                    # (B, N, D)
        return (x + pos).to(x.dtype).contiguous()


class CombinedTimestepTextProjEmbeddings(nn.Module):
    """temb = mlp(sin(t)) + mlp(pooled text), both SiLU MLPs."""

    def __init__(self, dim: int, pooled_dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)
        self.text_embedder = TimestepEmbedding(pooled_dim, dim)

    def forward(self, timestep: Tensor, pooled: Tensor) -> Tensor:
        temb = self.timestep_embedder(timestep_embedding(timestep).to(pooled.dtype))   # (B, D)
        return temb + self.text_embedder(pooled)                                         # (B, D)


class SD35AdaLayerNormZeroX(nn.Module):
    """AdaLayerNormZero with a second (shift, scale, gate) for the dual block's attn2: returns
    x for attn, the gates and MLP modulation, x for attn2 and its gate, in diffusers' order."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 9 * dim)

    def forward(self, x: Tensor, temb: Tensor) -> tuple[Tensor, ...]:
        (shift, scale, gate, shift_mlp, scale_mlp, gate_mlp,
         shift2, scale2, gate2) = self.linear(F.silu(temb)).chunk(9, dim=1)       # (B, D) each
        normed = F.layer_norm(x, x.shape[-1:], eps=1e-6)
        x1 = normed * (1 + scale[:, None]) + shift[:, None]
        x2 = normed * (1 + scale2[:, None]) + shift2[:, None]
        return x1, gate, shift_mlp, scale_mlp, gate_mlp, x2, gate2


# ---- attention and block -------------------------------------------------------------------

class SD3Attention(nn.Module):
    """Multi-head attention, optional RMS qk-norm. With `context`, the text tokens get their own
    projections (add_*_proj) and attend jointly with the image tokens as [img, txt]; a
    `context_pre_only` block has no text output projection (its text output is unused)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, qk_norm: str | None,
                 joint: bool = False, context_pre_only: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        inner = num_heads * head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner) for _ in range(3))
        self.norm_q, self.norm_k = self._norms(qk_norm, head_dim)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])
        if joint:
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner)
                                                                 for _ in range(3))
            self.norm_added_q, self.norm_added_k = self._norms(qk_norm, head_dim)
            if not context_pre_only:
                self.to_add_out = nn.Linear(inner, dim)

    @staticmethod
    def _norms(qk_norm: str | None, head_dim: int) -> tuple[nn.Module, nn.Module]:
        if qk_norm is None:
            return nn.Identity(), nn.Identity()
        return RMSNorm(head_dim, eps=1e-6), RMSNorm(head_dim, eps=1e-6)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (-1, self.head_dim))                         # (B, S, H, hd)

    def forward(self, x: Tensor, context: Tensor | None = None
                ) -> Tensor | tuple[Tensor, Tensor | None]:
        """x (B, N, D) [, context (B, T, D)] -> x's output [, context's output or None]."""
        q = self.norm_q(self._heads(self.to_q(x)))                          # (B, N, H, hd)
        k = self.norm_k(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        if context is not None:
            q = torch.cat([q, self.norm_added_q(self._heads(self.add_q_proj(context)))], dim=1)
            k = torch.cat([k, self.norm_added_k(self._heads(self.add_k_proj(context)))], dim=1)
            v = torch.cat([v, self._heads(self.add_v_proj(context))], dim=1)  # (B, N+T, H, hd)
        out = sdpa(q, k, v, None).flatten(2).to(q.dtype)                    # (B, S, H*hd)
        if context is None:
            return self.to_out[0](out)
        img, txt = out.split_with_sizes([x.shape[1], context.shape[1]], dim=1)
        txt_out = self.to_add_out(txt) if hasattr(self, "to_add_out") else None
        return self.to_out[0](img), txt_out


def _modulated_mlp(ff: FeedForward, x: Tensor, shift: Tensor, scale: Tensor, gate: Tensor
                   ) -> Tensor:
    h = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
    return x + gate.unsqueeze(1) * ff(h)


class SD3JointTransformerBlock(nn.Module):
    """diffusers' `JointTransformerBlock`: image and text streams with their own weights,
    one joint attention; `dual` adds attn2 over the image alone (3.5-medium)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, qk_norm: str | None,
                 context_pre_only: bool, dual: bool) -> None:
        super().__init__()
        self.context_pre_only, self.dual = context_pre_only, dual
        self.norm1 = SD35AdaLayerNormZeroX(dim) if dual else AdaLayerNormZero(dim)
        self.norm1_context = (AdaLayerNormContinuous(dim) if context_pre_only
                              else AdaLayerNormZero(dim))
        self.attn = SD3Attention(dim, num_heads, head_dim, qk_norm, joint=True,
                                 context_pre_only=context_pre_only)
        if dual:
            self.attn2 = SD3Attention(dim, num_heads, head_dim, qk_norm)
        self.ff = FeedForward(dim)
        if not context_pre_only:
            self.ff_context = FeedForward(dim)

    def forward(self, img: Tensor, txt: Tensor, temb: Tensor) -> tuple[Tensor, Tensor]:
        """img (B, N, D), txt (B, T, D) -> both updated (the last block leaves txt as it was:
        nothing reads it)."""
        img_h, gate_msa, shift_mlp, scale_mlp, gate_mlp, *second = self.norm1(img, temb)
        if self.context_pre_only:
            img_attn, _ = self.attn(img_h, self.norm1_context(txt, temb))
        else:
            txt_h, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(txt, temb)
            img_attn, txt_attn = self.attn(img_h, txt_h)
        img = img + gate_msa.unsqueeze(1) * img_attn
        if self.dual:
            img_h2, gate_msa2 = second
            img = img + gate_msa2.unsqueeze(1) * self.attn2(img_h2)
        img = _modulated_mlp(self.ff, img, shift_mlp, scale_mlp, gate_mlp)
        if not self.context_pre_only:
            txt = _modulated_mlp(self.ff_context, txt + c_gate_msa.unsqueeze(1) * txt_attn,
                                 c_shift_mlp, c_scale_mlp, c_gate_mlp)
        return img, txt


# ---- model ---------------------------------------------------------------------------------

class SD3Transformer2DModel(nn.Module):
    # FP8 (layers/fp8.py): linears left in bf16, besides those too small: the embeddings,
    # the blocks' modulation (norm1, norm1_context), the output norm's and the final projection
    fp8_keep = ("pos_embed.*", "time_text_embed.*", "context_embedder", "*.norm1.*",
                "*.norm1_context.*", "norm_out.*", "proj_out")

    def __init__(self, cfg: SD3TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim, heads, head_dim = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
        self.pos_embed = PatchEmbed(cfg.in_channels, dim, cfg.patch_size, cfg.pos_embed_max_size)
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(dim, cfg.pooled_projection_dim)
        self.context_embedder = nn.Linear(cfg.joint_attention_dim, cfg.caption_projection_dim)
        self.transformer_blocks = nn.ModuleList(
            [SD3JointTransformerBlock(dim, heads, head_dim, cfg.qk_norm,
                                      context_pre_only=i == cfg.num_layers - 1,
                                      dual=i in cfg.dual_attention_layers)
             for i in range(cfg.num_layers)])
        self.norm_out = AdaLayerNormContinuous(dim)
        self.proj_out = nn.Linear(dim, cfg.patch_size ** 2 * cfg.num_out_channels)

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor,
                pooled_projections: Tensor, timestep: Tensor,
                skip_layers: tuple[int, ...] = ()) -> Tensor:
        """hidden_states (B, C, h, w), encoder_hidden_states (B, T, joint), pooled (B, P),
        timestep (B,) in [0, 1000] as the scheduler's timesteps -> (B, C_out, h, w).
        skip_layers: blocks not run (skip-layer guidance)."""
        p = self.cfg.patch_size
        b, _, h, w = hidden_states.shape
        img = self.pos_embed(hidden_states)                                  # (B, N, D)
        temb = self.time_text_embed(timestep, pooled_projections)            # (B, D)
        txt = self.context_embedder(encoder_hidden_states)                   # (B, T, D)
        for i, block in enumerate(self.transformer_blocks):
            if i not in skip_layers:
                img, txt = block(img, txt, temb)
        out = self.proj_out(self.norm_out(img, temb))                        # (B, N, p*p*C)
        out = out.reshape(b, h // p, w // p, p, p, self.cfg.num_out_channels)
        return torch.einsum("nhwpqc->nchpwq", out).reshape(b, -1, h, w)      # (B, C, h, w)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> SD3Transformer2DModel:
        """Build from a diffusers folder (config.json + safetensors, maybe sharded) in `dtype`
        (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        return build_from_folder(cls, SD3TransformerConfig.from_dict(read_config(path)), path,
                                 device, dtype)
