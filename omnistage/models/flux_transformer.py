"""FLUX.1 (dev / schnell) transformer: diffusers' `FluxTransformer2DModel` in plain PyTorch.

Module and parameter names follow diffusers, so a diffusers `transformer/` folder loads by
name (`FluxTransformer2DModel.from_pretrained`); numerics follow
`diffusers/models/transformers/transformer_flux.py` op for op.

    img (B,N_img,in_ch) -> x_embedder ----------+     txt (B,N_txt,joint) -> context_embedder
    t*1000, guidance*1000, pooled -> temb (B,D) |     txt_ids ++ img_ids -> 3-axis rope (S,hd)
    num_layers x FluxTransformerBlock          two streams, joint attention over [txt, img]
    num_single_layers x FluxSingleTransformerBlock   one stream: parallel attention + MLP
    norm_out (AdaLayerNormContinuous) -> proj_out -> (B,N_img,out_ch)

D = num_attention_heads * attention_head_dim. The pipeline passes timestep and guidance
divided by 1000; the model scales them back, as diffusers does.

Several ranks (issue 18), from the stage's groups current at construction, as Qwen-Image:
q/k/v of both streams column-parallel, output projections row-parallel (the single block's
proj_out over [attention | MLP] piece by piece), MLPs column / row, the adaptive norms'
modulations split and gathered; text and image tokens split over the Ulysses x ring ranks
(layers/sequence_parallel.py), rotary tables alike, the image output gathered at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers import dit
from omnistage.layers.dit import (AdaLayerNormContinuous, AdaLayerNormZero, FeedForward,
                                  MergedRowParallelLinear, TimestepEmbedding, adaln_modulate,
                                  gated_add, timestep_embedding)
from omnistage.layers.parallel import ColumnParallelLinear, RowParallelLinear
from omnistage.layers.sequence_parallel import SequenceRanks, SequenceSplit, check_heads
from omnistage.layers.step_cache import CacheGroup, run_cached
from omnistage.models.diffusers_loader import (build_from_folder, config_from_dict,
                                               read_config)

# Step caching: the polynomial TeaCache fitted for FLUX.1 (relative L1 change of the first
# block's modulated input -> change of the blocks' output), highest power first
TEACACHE_COEFFICIENTS = (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00,
                         2.64230861e-01)

Rope = tuple[Tensor, Tensor]   # cos, sin: (S, head_dim) each, float32


@dataclass(frozen=True, slots=True)
class FluxTransformerConfig:
    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    def __post_init__(self) -> None:
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must sum to "
                             f"attention_head_dim {self.attention_head_dim}")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> FluxTransformerConfig:
        return config_from_dict(cls, raw, "FLUX transformer")


# ---- embeddings ----------------------------------------------------------------------------

class CombinedTimestepGuidanceTextProjEmbeddings(nn.Module):
    """temb = mlp(sin(t)) [+ mlp(sin(guidance))] + mlp(pooled text); the guidance branch
    exists only for guidance-distilled checkpoints (FLUX.1-dev)."""

    def __init__(self, dim: int, pooled_dim: int, has_guidance: bool) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)
        self.guidance_embedder = TimestepEmbedding(256, dim) if has_guidance else None
        self.text_embedder = TimestepEmbedding(pooled_dim, dim)

    def forward(self, timestep: Tensor, guidance: Tensor | None, pooled: Tensor) -> Tensor:
        temb = self.timestep_embedder(timestep_embedding(timestep).to(pooled.dtype))   # (B, D)
        if self.guidance_embedder is not None:
            if guidance is None:
                raise ValueError("this FLUX checkpoint has guidance_embeds: pass `guidance`")
            temb = temb + self.guidance_embedder(timestep_embedding(guidance).to(pooled.dtype))
        return temb + self.text_embedder(pooled)                                         # (B, D)


def flux_rope(ids: Tensor, axes_dim: tuple[int, ...], theta: float = 10000.0) -> Rope:
    """3-axis rotary tables from position ids (S, n_axes): each axis gets its slice of the head
    dim, frequencies in float64 as diffusers' FluxPosEmbed, each value repeated twice."""
    pos = ids.float()
    cos_out, sin_out = [], []
    for i, dim in enumerate(axes_dim):
        exponent = torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim
        freqs = 1.0 / theta ** exponent                                                # (dim/2,)
        angles = torch.outer(pos[:, i], freqs)                                         # (S, dim/2)
        cos_out.append(angles.cos().repeat_interleave(2, dim=1).float())               # (S, dim)
        sin_out.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos_out, dim=-1), torch.cat(sin_out, dim=-1)                      # (S, hd) x2


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of x: (B, S, H, hd)."""
    cos, sin = rope[0][None, :, None, :], rope[1][None, :, None, :]                   # (1,S,1,hd)
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)                       # (B,S,H,hd/2)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)                            # (B,S,H,hd)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


# ---- attention and blocks ------------------------------------------------------------------

class FluxAttention(nn.Module):
    """Multi-head attention with RMS qk-norm and rope. With `context_dim`, text tokens get their
    own projections (add_*_proj) and attend jointly with image tokens as [txt, img]. H below
    is this rank's heads; without an output projection the output is this rank's slice.
    bias False and eps: FLUX.2's double-stream attention (transformer_flux2.py)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, context_dim: int | None = None,
                 has_out_proj: bool = True, bias: bool = True, eps: float = 1e-6) -> None:
        super().__init__()
        self.head_dim = head_dim
        inner = num_heads * head_dim
        self.norm_q = nn.RMSNorm(head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.to_q, self.to_k, self.to_v = (ColumnParallelLinear(dim, inner, bias=bias)
                                           for _ in range(3))
        if has_out_proj:
            self.to_out = nn.ModuleList([RowParallelLinear(inner, dim, bias=bias),
                                         nn.Identity()])
        if context_dim is not None:
            self.norm_added_q = nn.RMSNorm(head_dim, eps=eps)
            self.norm_added_k = nn.RMSNorm(head_dim, eps=eps)
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (
                ColumnParallelLinear(context_dim, inner, bias=bias) for _ in range(3))
            self.to_add_out = RowParallelLinear(inner, dim, bias=bias)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (-1, self.head_dim))                       # (B, S, H, hd)

    def forward(self, x: Tensor, rope: Rope, seq: SequenceSplit, context: Tensor | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, N, D) and context (B, T, D): this rank's tokens; rope for [context, x]."""
        q, k = self._rotated_qk(x, rope, context)                           # (B, S, H, hd)
        v = self._heads(self.to_v(x))
        if context is not None:
            v = torch.cat([self._heads(self.add_v_proj(context)), v], dim=1)  # (B, T+N, H, hd)
        out = seq.attend(q, k, v).flatten(2).to(q.dtype)                    # (B, S, H*hd)
        if context is None:
            return out
        txt, img = out.split_with_sizes([context.shape[1], x.shape[1]], dim=1)
        return self.to_out[0](img.contiguous()), self.to_add_out(txt.contiguous())


    def _rotated_qk(self, x: Tensor, rope: Rope, context: Tensor | None
                    ) -> tuple[Tensor, Tensor]:
        """q and k of [context, x] (B, S, H, hd), normed per head and rotated. Where the fused
        kernels run, each stream's q / k norm and rope are one kernel, reading every other
        column of the tables (their values repeat in pairs: one angle per pair) in place."""
        streams = [(x, self.to_q, self.to_k, self.norm_q, self.norm_k)]
        if context is not None:
            streams.insert(0, (context, self.add_q_proj, self.add_k_proj, self.norm_added_q,
                               self.norm_added_k))
        if dit.fused_ops(x) is None:               # diffusers' order: norms, concat, rope
            q = torch.cat([nq(self._heads(pq(h))) for h, pq, _, nq, _ in streams], dim=1)
            k = torch.cat([nk(self._heads(pk(h))) for h, _, pk, _, nk in streams], dim=1)
            return apply_rope(q, rope), apply_rope(k, rope)
        cos, sin = rope[0][:, ::2], rope[1][:, ::2]                                # (S, hd/2)
        qs, ks, start = [], [], 0
        for h, pq, pk, nq, nk in streams:
            rows = slice(start, start + h.shape[1])
            qs.append(dit.norm_rope(nq, self._heads(pq(h)), cos[rows], sin[rows]))
            ks.append(dit.norm_rope(nk, self._heads(pk(h)), cos[rows], sin[rows]))
            start = rows.stop
        return torch.cat(qs, dim=1), torch.cat(ks, dim=1)


class FluxTransformerBlock(nn.Module):
    """Double-stream block: image and text keep separate weights, share one attention."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = AdaLayerNormZero(dim)
        self.norm1_context = AdaLayerNormZero(dim)
        self.attn = FluxAttention(dim, num_heads, head_dim, context_dim=dim)
        self.ff = FeedForward(dim)
        self.ff_context = FeedForward(dim)

    @staticmethod
    def _mlp(ff: FeedForward, x: Tensor, shift: Tensor, scale: Tensor, gate: Tensor) -> Tensor:
        h = adaln_modulate(x, scale[:, None], shift[:, None])
        return gated_add(x, ff(h), gate.unsqueeze(1))

    def forward(self, img: Tensor, txt: Tensor, temb: Tensor, rope: Rope, seq: SequenceSplit
                ) -> tuple[Tensor, Tensor]:
        img_h, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(img, temb)   # (B, N, D)
        txt_h, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(txt, temb)
        img_attn, txt_attn = self.attn(img_h, rope, seq, context=txt_h)
        img = self._mlp(self.ff, gated_add(img, img_attn, gate_msa.unsqueeze(1)),
                        shift_mlp, scale_mlp, gate_mlp)
        txt = self._mlp(self.ff_context, gated_add(txt, txt_attn, c_gate_msa.unsqueeze(1)),
                        c_shift_mlp, c_scale_mlp, c_gate_mlp)
        if txt.dtype == torch.float16:
            txt = txt.clip(-65504, 65504)
        return txt, img


class FluxSingleTransformerBlock(nn.Module):
    """Single-stream block over [txt, img]: attention and MLP in parallel, one output proj."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        mlp_dim = int(dim * mlp_ratio)
        self.norm = AdaLayerNormZero(dim, num_chunks=3)
        self.proj_mlp = ColumnParallelLinear(dim, mlp_dim, bias=True)
        self.proj_out = MergedRowParallelLinear([dim, mlp_dim], dim, bias=True)
        self.attn = FluxAttention(dim, num_heads, head_dim, has_out_proj=False)

    def forward(self, img: Tensor, txt: Tensor, temb: Tensor, rope: Rope, seq: SequenceSplit
                ) -> tuple[Tensor, Tensor]:
        num_txt = txt.shape[1]
        x = torch.cat([txt, img], dim=1)                                                 # (B, S, D)
        h, gate = self.norm(x, temb)
        mlp = F.gelu(self.proj_mlp(h), approximate="tanh")                         # (B, S, 4D)
        h = torch.cat([self.attn(h, rope, seq), mlp], dim=2)                       # (B, S, 5D)
        x = gated_add(x, self.proj_out(h), gate.unsqueeze(1))
        if x.dtype == torch.float16:
            x = x.clip(-65504, 65504)
        return x[:, :num_txt], x[:, num_txt:]


# ---- model ---------------------------------------------------------------------------------

class FluxTransformer2DModel(nn.Module):
    # FP8 (layers/fp8.py): linears left in bf16, besides those too small: the embeddings,
    # the blocks' modulation (norm1, norm1_context, the single blocks' norm) and the output
    # norm's, the final projection (a single block's proj_out is quantized)
    fp8_keep = ("time_text_embed.*", "context_embedder", "x_embedder", "*.norm1.*",
                "*.norm1_context.*", "*.norm.*", "norm_out.*", "proj_out")

    def __init__(self, cfg: FluxTransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim, heads, head_dim = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
        check_heads(heads)
        self.seq_ranks = SequenceRanks.current()
        out_channels = cfg.out_channels or cfg.in_channels
        self.time_text_embed = CombinedTimestepGuidanceTextProjEmbeddings(
            dim, cfg.pooled_projection_dim, cfg.guidance_embeds)
        self.context_embedder = nn.Linear(cfg.joint_attention_dim, dim)
        self.x_embedder = nn.Linear(cfg.in_channels, dim)
        self.transformer_blocks = nn.ModuleList(
            [FluxTransformerBlock(dim, heads, head_dim) for _ in range(cfg.num_layers)])
        self.single_transformer_blocks = nn.ModuleList(
            [FluxSingleTransformerBlock(dim, heads, head_dim)
             for _ in range(cfg.num_single_layers)])
        self.norm_out = AdaLayerNormContinuous(dim)
        self.proj_out = nn.Linear(dim, cfg.patch_size ** 2 * out_channels)

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor,
                pooled_projections: Tensor, timestep: Tensor, img_ids: Tensor, txt_ids: Tensor,
                guidance: Tensor | None = None, step_cache: list[CacheGroup] | None = None
                ) -> Tensor:
        """`step_cache`: per request, skip the blocks on steps whose first modulated input
        barely moved (layers/step_cache.py); None runs every block. Below, T and N count this
        rank's tokens (all of them with one sequence-parallel rank)."""
        num_txt, num_img = encoder_hidden_states.shape[1], hidden_states.shape[1]
        seq = SequenceSplit.split([num_txt, num_img], [None, None], self.seq_ranks)
        img = self.x_embedder(seq.local(hidden_states, 1))                               # (B, N, D)
        timestep = timestep.to(img.dtype) * 1000                                         # (B,)
        if guidance is not None:
            guidance = guidance.to(img.dtype) * 1000
        temb = self.time_text_embed(timestep, guidance, pooled_projections)              # (B, D)
        txt = self.context_embedder(seq.local(encoder_hidden_states, 0))                 # (B, T, D)
        rope = flux_rope(torch.cat([seq.local(txt_ids, 0, dim=0), seq.local(img_ids, 1, dim=0)]),
                         self.cfg.axes_dims_rope)                                        # (T+N, hd)

        def run_blocks(idx: Tensor | None) -> Tensor:
            i, t, e = (img, txt, temb) if idx is None else (img[idx], txt[idx], temb[idx])
            for block in self.transformer_blocks:
                t, i = block(i, t, e, rope, seq)
            for block in self.single_transformer_blocks:
                t, i = block(i, t, e, rope, seq)
            return i

        if step_cache is None:
            img = run_blocks(None)
        else:
            modulated = self.transformer_blocks[0].norm1(img, temb)[0]                   # (B, N, D)
            img = run_cached(img, modulated, step_cache, TEACACHE_COEFFICIENTS, run_blocks)
        return seq.gather(self.proj_out(self.norm_out(img, temb)), 1)       # (B, all N, out)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> FluxTransformer2DModel:
        """Build from a diffusers folder (config.json + safetensors, maybe sharded) in `dtype`
        (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        return build_from_folder(cls, FluxTransformerConfig.from_dict(read_config(path)), path, device,
                                 dtype)
