"""HunyuanVideo-1.5's transformer parts below the model (hunyuan_video15_transformer.py has the
picture): the condition embedders (timestep, the Qwen2.5-VL token refiner, the byT5 glyph and
SigLIP image projections), the 3D rope table and the dual-stream block with its joint attention.
Names follow diffusers' `transformer_hunyuan_video15.py`, so checkpoint keys map one-to-one.

H below is this rank's heads (all of them with one tensor-parallel rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.dit import (AdaLayerNormZero, FeedForward, TimestepEmbedding,
                                  adaln_modulate, gated_add, norm_rope, timestep_embedding)
from omnistage.layers.norm import RMSNorm
from omnistage.layers.parallel import ColumnParallelLinear, RowParallelLinear
from omnistage.layers.sequence_parallel import SequenceSplit, sdpa

Rope = tuple[Tensor, Tensor]     # cos, sin: (N, hd/2) float32, one angle per pair of features


def hunyuan_rope(grid: tuple[int, int, int], axes_dim: tuple[int, ...], theta: float,
                 device: torch.device) -> Rope:
    """diffusers' HunyuanVideo15RotaryPosEmbed for an F' x H' x W' token grid (frame-major, as
    the patch embedding flattens): the head's pairs split into frame, row and column parts of
    axes_dim[i] / 2 pairs each, rotated by the token's position on that axis; float32 as
    diffusers' get_1d_rotary_pos_embed."""
    if sum(axes_dim) % 2 or any(d % 2 for d in axes_dim):
        raise ValueError(f"rope_axes_dim {axes_dim}: each axis needs an even width")
    f, h, w = grid
    axes = []
    for n, dim in zip(grid, axes_dim):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                             device=device)[: dim // 2] / dim)
        axes.append(torch.outer(torch.arange(n, dtype=torch.float32, device=device), freqs))
    angles = torch.cat([axes[0][:, None, None].expand(f, h, w, -1),
                        axes[1][None, :, None].expand(f, h, w, -1),
                        axes[2][None, None, :].expand(f, h, w, -1)], dim=-1)   # (F', H', W', hd/2)
    angles = angles.reshape(f * h * w, -1)
    return angles.cos(), angles.sin()


# ---- condition embedders -------------------------------------------------------------------

class HunyuanVideo15TimeEmbedding(nn.Module):
    """Timestep -> (B, D); MeanFlow checkpoints (the super-resolution ones) add the embedding of
    the step's target timestep `timestep_r` through their own MLP."""

    def __init__(self, dim: int, use_meanflow: bool) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)
        self.timestep_embedder_r = TimestepEmbedding(256, dim) if use_meanflow else None

    def forward(self, timestep: Tensor, timestep_r: Tensor | None) -> Tensor:
        # diffusers rounds the sinusoid to the timestep's dtype (the latents'), then embeds
        temb = self.timestep_embedder(timestep_embedding(timestep).to(timestep.dtype))
        if timestep_r is not None:
            if self.timestep_embedder_r is None:
                raise ValueError("timestep_r: only MeanFlow checkpoints (use_meanflow) take it")
            temb = temb + self.timestep_embedder_r(
                timestep_embedding(timestep_r).to(timestep.dtype))
        return temb


class CombinedTimestepTextProj(nn.Module):
    """The refiner's conditioning: timestep MLP + the masked mean of the text, projected."""

    def __init__(self, dim: int, pooled_dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)
        self.text_embedder = TimestepEmbedding(pooled_dim, dim)     # linear, SiLU, linear

    def forward(self, timestep: Tensor, pooled: Tensor) -> Tensor:
        t = self.timestep_embedder(timestep_embedding(timestep).to(pooled.dtype))
        return t + self.text_embedder(pooled)


class RefinerAttention(nn.Module):
    """Plain self-attention over the text tokens (bias, no q/k norm), padded keys masked."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Identity()])

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)) for p in (self.to_q, self.to_k,
                                                                      self.to_v))
        return self.to_out[0](sdpa(q, k, v, mask).flatten(2).to(x.dtype))


class HunyuanVideo15IndividualTokenRefinerBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = RefinerAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.ff = FeedForward(dim, inner_dim=int(dim * mlp_ratio), activation="linear-silu")
        self.norm_out = nn.Module()
        self.norm_out.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: Tensor, temb: Tensor, mask: Tensor) -> Tensor:
        gate_msa, gate_mlp = self.norm_out.linear(F.silu(temb)).unsqueeze(1).chunk(2, dim=-1)
        x = x + self.attn(self.norm1(x), mask) * gate_msa
        return x + self.ff(self.norm2(x)) * gate_mlp


class HunyuanVideo15TokenRefiner(nn.Module):
    """Qwen2.5-VL hidden states (B, L, text_dim) -> (B, L, D): projected, then refined by a few
    self-attention blocks conditioned on the timestep and the caption's masked mean."""

    def __init__(self, in_dim: int, dim: int, num_heads: int, num_layers: int) -> None:
        super().__init__()
        self.time_text_embed = CombinedTimestepTextProj(dim, in_dim)
        self.proj_in = nn.Linear(in_dim, dim)
        self.token_refiner = nn.Module()
        self.token_refiner.refiner_blocks = nn.ModuleList(
            [HunyuanVideo15IndividualTokenRefinerBlock(dim, num_heads, 4.0)
             for _ in range(num_layers)])

    def forward(self, text: Tensor, timestep: Tensor, mask: Tensor) -> Tensor:
        weights = mask.float().unsqueeze(-1)                                    # (B, L, 1)
        pooled = ((text * weights).sum(1) / weights.sum(1)).to(text.dtype)
        temb = self.time_text_embed(timestep, pooled)
        x = self.proj_in(text)
        for block in self.token_refiner.refiner_blocks:
            x = block(x, temb, mask)
        return x


class HunyuanVideo15ByT5TextProjection(nn.Module):
    """byT5 glyph states -> D: LayerNorm, linear, GELU, linear, GELU, linear."""

    def __init__(self, in_dim: int, hidden: int, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(in_dim)
        self.linear_1, self.linear_2 = nn.Linear(in_dim, hidden), nn.Linear(hidden, hidden)
        self.linear_3 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        x = F.gelu(self.linear_1(self.norm(x)))
        return self.linear_3(F.gelu(self.linear_2(x)))


class HunyuanVideo15ImageProjection(nn.Module):
    """SigLIP image tokens -> D: LayerNorm, linear, GELU, linear, LayerNorm."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.norm_in = nn.LayerNorm(in_dim)
        self.linear_1, self.linear_2 = nn.Linear(in_dim, in_dim), nn.Linear(in_dim, dim)
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm_out(self.linear_2(F.gelu(self.linear_1(self.norm_in(x)))))


# ---- joint attention and the block ---------------------------------------------------------

class HunyuanVideo15Attention(nn.Module):
    """Video and context tokens keep their own q/k/v/out projections and per-head RMSNorms and
    attend together as [video, context]; rope on the video tokens only (the context has no
    position: its order does not matter); masked context keys are left out (`seq` holds the
    mask, and with several sequence-parallel ranks the exchange)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim

        def column() -> ColumnParallelLinear:
            return ColumnParallelLinear(dim, num_heads * head_dim, bias=True)

        self.to_q, self.to_k, self.to_v = column(), column(), column()
        self.add_q_proj, self.add_k_proj, self.add_v_proj = column(), column(), column()
        self.norm_q, self.norm_k = RMSNorm(head_dim), RMSNorm(head_dim)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim), RMSNorm(head_dim)
        self.to_out = nn.ModuleList([RowParallelLinear(num_heads * head_dim, dim, bias=True),
                                     nn.Identity()])
        self.to_add_out = RowParallelLinear(num_heads * head_dim, dim, bias=True)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (-1, self.head_dim))                            # (B, S, H, hd)

    def forward(self, x: Tensor, ctx: Tensor, seq: SequenceSplit, rope: Rope
                ) -> tuple[Tensor, Tensor]:
        """x (B, N, D) video, ctx (B, L, D) context: this rank's tokens of each."""
        q = norm_rope(self.norm_q, self._heads(self.to_q(x)), *rope)            # (B, N, H, hd)
        k = norm_rope(self.norm_k, self._heads(self.to_k(x)), *rope)
        q = torch.cat([q, self.norm_added_q(self._heads(self.add_q_proj(ctx)))], dim=1)
        k = torch.cat([k, self.norm_added_k(self._heads(self.add_k_proj(ctx)))], dim=1)
        v = torch.cat([self._heads(self.to_v(x)), self._heads(self.add_v_proj(ctx))], dim=1)
        out = seq.attend(q, k, v).flatten(2).to(x.dtype)                        # (B, N+L, H*hd)
        video, context = out.split_with_sizes([x.shape[1], ctx.shape[1]], dim=1)
        return self.to_out[0](video.contiguous()), self.to_add_out(context.contiguous())


class HunyuanVideo15TransformerBlock(nn.Module):
    """Dual stream, AdaLN-Zero on each: x += gate * attn(...); x += gate' * ff(mod(norm(x)))."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1, self.norm1_context = AdaLayerNormZero(dim), AdaLayerNormZero(dim)
        self.attn = HunyuanVideo15Attention(dim, num_heads, head_dim)
        self.ff = FeedForward(dim, inner_dim=int(dim * mlp_ratio))
        self.ff_context = FeedForward(dim, inner_dim=int(dim * mlp_ratio))

    def modulated_input(self, x: Tensor, temb: Tensor) -> Tensor:
        """The video stream's first modulated input (what step caching watches)."""
        return self.norm1(x, temb)[0]

    def forward(self, x: Tensor, ctx: Tensor, temb: Tensor, seq: SequenceSplit, rope: Rope
                ) -> tuple[Tensor, Tensor]:
        h, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb)           # (B, D) each
        c, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(ctx, temb)
        attn, ctx_attn = self.attn(h, c, seq, rope)
        x = gated_add(x, attn, gate[:, None])
        ctx = gated_add(ctx, ctx_attn, c_gate[:, None])
        h = adaln_modulate(x, scale_mlp[:, None], shift_mlp[:, None])
        c = adaln_modulate(ctx, c_scale_mlp[:, None], c_shift_mlp[:, None])
        x = gated_add(x, self.ff(h), gate_mlp[:, None])
        ctx = gated_add(ctx, self.ff_context(c), c_gate_mlp[:, None])
        return x, ctx
