"""FLUX.2 (dev / klein) transformer: diffusers' `Flux2Transformer2DModel` in plain PyTorch.

Module and parameter names follow diffusers, so a diffusers `transformer/` folder loads by
name; numerics follow `diffusers/models/transformers/transformer_flux2.py` op for op. What it
shares with FLUX.1 (flux_transformer.py): the joint attention with RMS qk-norm (bias-free
here), the axis-wise rotary tables (4 axes, theta 2000) and their interleaved rotation.

    img (B,N,in_ch) -> x_embedder              txt (B,T,joint) -> context_embedder
    t*1000 [, guidance*1000] -> temb (B,D)     txt_ids ++ img_ids (T,axes / N,axes) -> rope
    temb -> three shared modulations: double img (6D), double txt (6D), single (3D)
    num_layers x Flux2TransformerBlock          two streams, joint attention over [txt, img]
    num_single_layers x Flux2SingleTransformerBlock   one stream: one fused projection feeds
                                                      attention and a SwiGLU MLP
    norm_out (AdaLayerNormContinuous) -> proj_out -> (B,N,out_ch)

Unlike FLUX.1 the blocks carry no modulation of their own (three tables computed once from
temb serve every block), no pooled text embedding, and every linear is bias-free. Reference
images of an edit are more image tokens (with their own position ids); the caller slices them
off the output. Step caching uses identity rescaling (no fitted polynomial for FLUX.2).
Runs on one rank: its pipeline splits along no parallel axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.dit import AdaLayerNormContinuous, TimestepEmbedding, timestep_embedding
from omnistage.layers.sequence_parallel import SequenceRanks, SequenceSplit, check_heads
from omnistage.layers.step_cache import CacheGroup, run_cached
from omnistage.models.diffusers_loader import (build_from_folder, config_from_dict,
                                               read_config)
from omnistage.models.flux_transformer import FluxAttention, Rope, apply_rope, flux_rope

TEACACHE_COEFFICIENTS = (1.0, 0.0)   # identity: the raw relative change of the modulated input


@dataclass(frozen=True, slots=True)
class Flux2TransformerConfig:
    patch_size: int = 1
    in_channels: int = 128
    out_channels: int | None = None
    num_layers: int = 8
    num_single_layers: int = 48
    attention_head_dim: int = 128
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360
    timestep_guidance_channels: int = 256
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)
    rope_theta: int = 2000
    eps: float = 1e-6
    guidance_embeds: bool = True

    def __post_init__(self) -> None:
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must sum to "
                             f"attention_head_dim {self.attention_head_dim}")
        if self.patch_size != 1:
            raise ValueError(f"patch_size {self.patch_size}: FLUX.2 packs 2x2 latent patches "
                             "in the pipeline; only patch_size 1 is supported")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> Flux2TransformerConfig:
        return config_from_dict(cls, raw, "FLUX.2 transformer")


# ---- embeddings and modulation ---------------------------------------------------------------

class Flux2TimestepGuidanceEmbeddings(nn.Module):
    """temb = mlp(sin(t)) [+ mlp(sin(guidance))]; the guidance branch exists only for the
    guidance-distilled checkpoint (FLUX.2-dev), and is skipped when no guidance is given."""

    def __init__(self, in_dim: int, dim: int, has_guidance: bool) -> None:
        super().__init__()
        self.in_dim = in_dim
        self.timestep_embedder = TimestepEmbedding(in_dim, dim, bias=False)
        self.guidance_embedder = (TimestepEmbedding(in_dim, dim, bias=False) if has_guidance
                                  else None)

    def forward(self, timestep: Tensor, guidance: Tensor | None) -> Tensor:
        temb = self.timestep_embedder(timestep_embedding(timestep, self.in_dim).to(timestep.dtype))
        if guidance is not None and self.guidance_embedder is not None:
            temb = temb + self.guidance_embedder(
                timestep_embedding(guidance, self.in_dim).to(guidance.dtype))
        return temb                                                                   # (B, D)


class Flux2Modulation(nn.Module):
    """silu(temb) -> linear: `num_sets` x (shift, scale, gate), shared by every block."""

    def __init__(self, dim: int, num_sets: int) -> None:
        super().__init__()
        self.num_sets = num_sets
        self.linear = nn.Linear(dim, dim * 3 * num_sets, bias=False)

    def forward(self, temb: Tensor) -> list[tuple[Tensor, ...]]:
        chunks = self.linear(F.silu(temb)).unsqueeze(1).chunk(3 * self.num_sets, dim=-1)
        return [chunks[3 * i:3 * i + 3] for i in range(self.num_sets)]   # each (B, 1, D)


def modulate(x: Tensor, shift: Tensor, scale: Tensor, eps: float) -> Tensor:
    """Affine-free LayerNorm, then the modulation's scale and shift."""
    return (1 + scale) * F.layer_norm(x, x.shape[-1:], eps=eps) + shift


# ---- blocks ----------------------------------------------------------------------------------

class Flux2FeedForward(nn.Module):
    """linear_in (to 2 x inner) -> SwiGLU (silu(first half) * second half) -> linear_out."""

    def __init__(self, dim: int, mlp_ratio: float) -> None:
        super().__init__()
        inner = int(dim * mlp_ratio)
        self.linear_in = nn.Linear(dim, 2 * inner, bias=False)
        self.linear_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.linear_in(x).chunk(2, dim=-1)
        return self.linear_out(F.silu(gate) * up)


class Flux2TransformerBlock(nn.Module):
    """Double-stream block: image and text keep separate weights, share one attention."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float, eps: float
                 ) -> None:
        super().__init__()
        self.eps = eps
        self.attn = FluxAttention(dim, num_heads, head_dim, context_dim=dim, bias=False, eps=eps)
        self.ff = Flux2FeedForward(dim, mlp_ratio)
        self.ff_context = Flux2FeedForward(dim, mlp_ratio)

    def forward(self, img: Tensor, txt: Tensor, mod_img: list[tuple[Tensor, ...]],
                mod_txt: list[tuple[Tensor, ...]], rope: Rope, seq: SequenceSplit
                ) -> tuple[Tensor, Tensor]:
        (shift, scale, gate), (shift_mlp, scale_mlp, gate_mlp) = mod_img
        (c_shift, c_scale, c_gate), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = mod_txt
        img_attn, txt_attn = self.attn(modulate(img, shift, scale, self.eps), rope, seq,
                                       context=modulate(txt, c_shift, c_scale, self.eps))
        img = img + gate * img_attn                                                  # (B, N, D)
        img = img + gate_mlp * self.ff(modulate(img, shift_mlp, scale_mlp, self.eps))
        txt = txt + c_gate * txt_attn                                                # (B, T, D)
        txt = txt + c_gate_mlp * self.ff_context(modulate(txt, c_shift_mlp, c_scale_mlp,
                                                          self.eps))
        if txt.dtype == torch.float16:
            txt = txt.clip(-65504, 65504)
        return txt, img


class Flux2ParallelSelfAttention(nn.Module):
    """One projection gives q, k, v and the MLP's gate and up; one projection takes the
    attention output and the MLP's back (ViT-22B's parallel block)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float, eps: float
                 ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inner = num_heads * head_dim
        self.mlp_hidden = int(dim * mlp_ratio)
        self.to_qkv_mlp_proj = nn.Linear(dim, 3 * self.inner + 2 * self.mlp_hidden, bias=False)
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_out = nn.Linear(self.inner + self.mlp_hidden, dim, bias=False)

    def forward(self, x: Tensor, rope: Rope, seq: SequenceSplit) -> Tensor:
        qkv, mlp = self.to_qkv_mlp_proj(x).split([3 * self.inner, 2 * self.mlp_hidden], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv.chunk(3, dim=-1))
        q, k = apply_rope(self.norm_q(q), rope), apply_rope(self.norm_k(k), rope)  # (B,S,H,hd)
        attn = seq.attend(q, k, v).flatten(2).to(q.dtype)                         # (B, S, inner)
        gate, up = mlp.chunk(2, dim=-1)
        return self.to_out(torch.cat([attn, F.silu(gate) * up], dim=-1))            # (B, S, D)


class Flux2SingleTransformerBlock(nn.Module):
    """Single-stream block over [txt, img]."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float, eps: float
                 ) -> None:
        super().__init__()
        self.eps = eps
        self.attn = Flux2ParallelSelfAttention(dim, num_heads, head_dim, mlp_ratio, eps)

    def forward(self, x: Tensor, mod: list[tuple[Tensor, ...]], rope: Rope, seq: SequenceSplit
                ) -> Tensor:
        (shift, scale, gate), = mod
        x = x + gate * self.attn(modulate(x, shift, scale, self.eps), rope, seq)     # (B, S, D)
        if x.dtype == torch.float16:
            x = x.clip(-65504, 65504)
        return x


# ---- model -----------------------------------------------------------------------------------

class Flux2Transformer2DModel(nn.Module):
    def __init__(self, cfg: Flux2TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim, heads, head_dim = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
        check_heads(heads)
        self.seq_ranks = SequenceRanks.current()
        block_args = (dim, heads, head_dim, cfg.mlp_ratio, cfg.eps)
        self.time_guidance_embed = Flux2TimestepGuidanceEmbeddings(
            cfg.timestep_guidance_channels, dim, cfg.guidance_embeds)
        self.double_stream_modulation_img = Flux2Modulation(dim, 2)
        self.double_stream_modulation_txt = Flux2Modulation(dim, 2)
        self.single_stream_modulation = Flux2Modulation(dim, 1)
        self.x_embedder = nn.Linear(cfg.in_channels, dim, bias=False)
        self.context_embedder = nn.Linear(cfg.joint_attention_dim, dim, bias=False)
        self.transformer_blocks = nn.ModuleList(
            [Flux2TransformerBlock(*block_args) for _ in range(cfg.num_layers)])
        self.single_transformer_blocks = nn.ModuleList(
            [Flux2SingleTransformerBlock(*block_args) for _ in range(cfg.num_single_layers)])
        self.norm_out = AdaLayerNormContinuous(dim, bias=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels or cfg.in_channels, bias=False)

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor, timestep: Tensor,
                img_ids: Tensor, txt_ids: Tensor, guidance: Tensor | None = None,
                step_cache: list[CacheGroup] | None = None) -> Tensor:
        """hidden_states (B, N, in_ch): the latent tokens, then any reference-image tokens;
        encoder_hidden_states (B, T, joint); timestep, guidance (B,) divided by 1000 as the
        pipelines pass them; img_ids (N, axes), txt_ids (T, axes) shared by every row.
        `step_cache`: per request, skip the blocks on steps whose first modulated input barely
        moved (layers/step_cache.py). -> (B, N, out_ch)."""
        num_txt, num_img = encoder_hidden_states.shape[1], hidden_states.shape[1]
        seq = SequenceSplit.split([num_txt, num_img], [None, None], self.seq_ranks)
        img = self.x_embedder(hidden_states)                                         # (B, N, D)
        timestep = timestep.to(img.dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(img.dtype) * 1000
        temb = self.time_guidance_embed(timestep, guidance)                          # (B, D)
        mod_img = self.double_stream_modulation_img(temb)
        mod_txt = self.double_stream_modulation_txt(temb)
        mod_single = self.single_stream_modulation(temb)
        txt = self.context_embedder(encoder_hidden_states)                           # (B, T, D)
        rope = flux_rope(torch.cat([txt_ids, img_ids]), self.cfg.axes_dims_rope,
                         float(self.cfg.rope_theta))                                 # (T+N, hd)

        def rows(mods: list[tuple[Tensor, ...]], idx: Tensor | None) -> list[tuple[Tensor, ...]]:
            return mods if idx is None else [tuple(m[idx] for m in s) for s in mods]

        def run_blocks(idx: Tensor | None) -> Tensor:
            i, t = (img, txt) if idx is None else (img[idx], txt[idx])
            m_img, m_txt, m_single = (rows(m, idx) for m in (mod_img, mod_txt, mod_single))
            for block in self.transformer_blocks:
                t, i = block(i, t, m_img, m_txt, rope, seq)
            x = torch.cat([t, i], dim=1)                                             # (b, T+N, D)
            for block in self.single_transformer_blocks:
                x = block(x, m_single, rope, seq)
            return x[:, num_txt:]

        if step_cache is None:
            img = run_blocks(None)
        else:
            (shift, scale, _), _ = mod_img
            modulated = modulate(img, shift, scale, self.cfg.eps)                    # (B, N, D)
            img = run_cached(img, modulated, step_cache, TEACACHE_COEFFICIENTS, run_blocks)
        return self.proj_out(self.norm_out(img, temb))                               # (B, N, out)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Flux2Transformer2DModel:
        """Build from a diffusers folder (config.json + safetensors, maybe sharded) in `dtype`
        (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        return build_from_folder(cls, Flux2TransformerConfig.from_dict(read_config(path)), path,
                                 device, dtype)
