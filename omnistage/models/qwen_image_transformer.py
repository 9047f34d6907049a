"""Qwen-Image transformer: diffusers' `QwenImageTransformer2DModel` in plain PyTorch.

Module and parameter names follow diffusers, so a diffusers `transformer/` folder loads by
name (`QwenImageTransformer2DModel.from_pretrained`); numerics follow
`diffusers/models/transformers/transformer_qwenimage.py` op for op.

    img (B,N,in_ch) -> img_in ------------------+   txt (B,T,joint) -> txt_norm -> txt_in
    timestep -> sin(t*1000) -> mlp -> temb (B,D) |   img_shapes -> complex rope: img (N,hd/2),
                                                 |                               txt (T,hd/2)
    num_layers x QwenImageTransformerBlock    two streams, joint attention over [txt, img]
    norm_out (AdaLayerNormContinuous) -> proj_out -> (B,N,patch^2*out_ch)

D = num_attention_heads * attention_head_dim. Unlike FLUX, the pipeline passes timestep in
[0, 1]; the sinusoid scales it by 1000. The text mask (B,T) hides padded text keys.
Step caching (`step_cache`, layers/step_cache.py) watches the first block's modulated image
stream and reuses the blocks' image residual; the text stream's output is never used after the
blocks, so only the image residual (fixed length N per request) is kept.
Not supported: `use_layer3d_rope` (Qwen-Image-Layered), ControlNet residuals. diffusers' own
`guidance` path cannot run (and `guidance_embeds` adds no weights), so there is no `guidance`.

Several ranks (issue 18), from the stage's groups current at construction:
  tensor parallel  every block's q/k/v of both streams column-parallel (this rank's heads),
                   their output projections row-parallel, the MLPs column / row, the blocks'
                   modulation projections split by output and gathered; embeddings, output norm
                   and projection whole on every rank
  sequence par.    text and image tokens split over the Ulysses x ring ranks
                   (layers/sequence_parallel.py), rotary tables sliced alike; the image output
                   gathered whole at the end. Heads must divide by ulysses x tp.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.layers.dit import (AdaLayerNormContinuous, FeedForward, TimestepEmbedding,
                                  adaln_modulate, gated_add, norm_rope)
from omnistage.layers.parallel import ColumnParallelLinear, RowParallelLinear
from omnistage.layers.sequence_parallel import SequenceRanks, SequenceSplit, check_heads
from omnistage.layers.step_cache import CacheGroup, run_cached
from omnistage.models.diffusers_loader import (build_from_folder, config_from_dict,
                                               read_config)

# Step caching: no TeaCache-fitted polynomial for Qwen-Image is known to us. vllm-omni ships one
# it attributes to ComfyUI-TeaCache, (-450, 280, -45, 3.2, -0.02), hand-tuned for the small
# per-step changes of the real model: it is negative below ~0.007 and above ~0.43, where it
# would make large changes count as none. So the relative L1 change is used as is (identity
# rescaling, as for Z-Image); thresholds are then in units of that change.
TEACACHE_COEFFICIENTS = (1.0, 0.0)

Rope = tuple[Tensor, Tensor]     # img (N, hd/2), txt (T, hd/2): complex64 rotations
ImgShapes = list[list[tuple[int, int, int]]] | list[tuple[int, int, int]]


@dataclass(frozen=True, slots=True)
class QwenImageTransformerConfig:
    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False      # accepted for config compatibility; no weights
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    zero_cond_t: bool = False          # Qwen-Image-Edit-2511: condition images see t = 0
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    def __post_init__(self) -> None:
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must sum to "
                             f"attention_head_dim {self.attention_head_dim}")
        if self.use_layer3d_rope:
            raise ValueError("use_layer3d_rope (Qwen-Image-Layered) is not supported")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> QwenImageTransformerConfig:
        return config_from_dict(cls, raw, "Qwen-Image transformer")


# ---- embeddings ----------------------------------------------------------------------------

def timestep_embedding(t: Tensor, dim: int = 256, scale: float = 1000.0) -> Tensor:
    """diffusers Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000): the scale
    multiplies t*freq (not t first), as diffusers does, so rounding matches."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(exponent / half)                               # (half,)
    args = scale * (t[:, None].float() * freqs[None, :])             # (B, half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)     # (B, dim)


class QwenTimestepProjEmbeddings(nn.Module):
    def __init__(self, dim: int, use_additional_t_cond: bool) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)
        if use_additional_t_cond:
            self.addition_t_embedding = nn.Embedding(2, dim)

    def forward(self, timestep: Tensor, dtype: torch.dtype, t_cond: Tensor | None) -> Tensor:
        temb = self.timestep_embedder(timestep_embedding(timestep).to(dtype))      # (B, D)
        if hasattr(self, "addition_t_embedding"):
            if t_cond is None:
                raise ValueError("this checkpoint has use_additional_t_cond: pass additional_t_cond")
            temb = temb + self.addition_t_embedding(t_cond).to(dtype)
        return temb


def _axis_freqs(pos: Tensor, dim: int, theta: float = 10000.0) -> Tensor:
    """(len(pos), dim/2) complex64 e^{i*pos*freq}, computed as diffusers' rope_params."""
    inv = 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim))
    angles = torch.outer(pos, inv)
    return torch.polar(torch.ones_like(angles), angles)


def _centered(n: int) -> Tensor:
    """scale_rope positions -(n - n//2) .. n//2 - 1: image rows/cols centred on zero."""
    return torch.arange(-(n - n // 2), n // 2)


def qwen_rope(img_shapes: ImgShapes, num_txt: int, axes_dim: tuple[int, ...],
              device: torch.device) -> Rope:
    """diffusers' QwenEmbedRope (scale_rope=True). One sample's shape list is used for the
    whole batch: images [target, cond_1, ...] get frame index 0, 1, ...; text positions start
    after the largest half-extent, on the diagonal. Kept per shape on the device: every step
    of a request asks for the same tables, and a forward replayed from a CUDA graph may not
    copy them from the host."""
    shapes = img_shapes[0]
    if any(s != shapes for s in img_shapes):
        raise ValueError(f"img_shapes must be the same for every sample, got {img_shapes}")
    if not isinstance(shapes, list):
        shapes = [shapes]
    return _rope_tables(tuple(tuple(s) for s in shapes), num_txt, tuple(axes_dim), device)


@functools.lru_cache(maxsize=16)
def _rope_tables(shapes: tuple[tuple[int, int, int], ...], num_txt: int,
                 axes_dim: tuple[int, ...], device: torch.device) -> Rope:
    img, max_idx = [], 0
    for idx, (frame, height, width) in enumerate(shapes):
        f = _axis_freqs(torch.arange(idx, idx + frame), axes_dim[0])           # (F, a0/2)
        h = _axis_freqs(_centered(height), axes_dim[1])                       # (Hh, a1/2)
        w = _axis_freqs(_centered(width), axes_dim[2])                        # (Ww, a2/2)
        img.append(torch.cat([f[:, None, None].expand(frame, height, width, -1),
                              h[None, :, None].expand(frame, height, width, -1),
                              w[None, None, :].expand(frame, height, width, -1)], dim=-1)
                   .reshape(frame * height * width, -1))                     # (FHW, hd/2)
        max_idx = max(height // 2, width // 2, max_idx)
    txt_pos = torch.arange(max_idx, max_idx + num_txt)
    txt = torch.cat([_axis_freqs(txt_pos, d) for d in axes_dim], dim=-1)      # (T, hd/2)
    return torch.cat(img, dim=0).to(device), txt.to(device)


class RMSNorm(nn.Module):
    """diffusers' RMSNorm (weight, no bias): fp32 statistics, cast only for half weights."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


# ---- attention and block -------------------------------------------------------------------

class QwenImageAttention(nn.Module):
    """Joint attention: image and text keep separate q/k/v/out projections and qk-norms, and
    attend together as [txt, img]; padded text keys are masked out (`seq` holds the mask).
    H below is this rank's heads (all of them with one tensor-parallel rank)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        inner = num_heads * head_dim

        def column() -> ColumnParallelLinear:
            return ColumnParallelLinear(dim, inner, bias=True)

        self.norm_q, self.norm_k = RMSNorm(head_dim), RMSNorm(head_dim)
        self.to_q, self.to_k, self.to_v = column(), column(), column()
        self.add_k_proj, self.add_v_proj, self.add_q_proj = column(), column(), column()
        self.to_out = nn.ModuleList([RowParallelLinear(inner, dim, bias=True), nn.Identity()])
        self.to_add_out = RowParallelLinear(inner, dim, bias=True)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim), RMSNorm(head_dim)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (-1, self.head_dim))                           # (B, S, H, hd)

    def forward(self, img: Tensor, txt: Tensor, seq: SequenceSplit, rope: Rope
                ) -> tuple[Tensor, Tensor]:
        """img (B, N, D), txt (B, T, D): this rank's tokens of each; rope sliced alike."""
        img_rope, txt_rope = rope

        def rotate(norm: RMSNorm, x: Tensor, freqs: Tensor) -> Tensor:
            """norm, then diffusers' complex multiply by freqs; one kernel on CUDA."""
            return norm_rope(norm, self._heads(x), freqs.real, freqs.imag)

        q = rotate(self.norm_q, self.to_q(img), img_rope)                       # (B, N, H, hd)
        k = rotate(self.norm_k, self.to_k(img), img_rope)
        txt_q = rotate(self.norm_added_q, self.add_q_proj(txt), txt_rope)        # (B, T, H, hd)
        txt_k = rotate(self.norm_added_k, self.add_k_proj(txt), txt_rope)
        q = torch.cat([txt_q, q], dim=1)                                        # (B, T+N, H, hd)
        k = torch.cat([txt_k, k], dim=1)
        v = torch.cat([self._heads(self.add_v_proj(txt)), self._heads(self.to_v(img))], dim=1)
        out = seq.attend(q, k, v).flatten(2).to(q.dtype)                        # (B, T+N, H*hd)
        txt_out, img_out = out.split_with_sizes([txt.shape[1], img.shape[1]], dim=1)
        return self.to_out[0](img_out.contiguous()), self.to_add_out(txt_out.contiguous())


def _modulate(x: Tensor, params: Tensor, index: Tensor | None) -> tuple[Tensor, Tensor]:
    """LayerNorm(x) * (1 + scale) + shift, and the gate. params: (B, 3D), or with zero_cond_t
    (2B, 3D) = [t rows, t=0 rows] picked per token by index (B, N): 0 target, 1 condition."""
    shift, scale, gate = (p.unsqueeze(1) for p in params.chunk(3, dim=-1))    # (B|2B, 1, D)
    if index is not None:
        b, pick = shift.shape[0] // 2, index.unsqueeze(-1) == 0               # pick: (B, N, 1)
        shift, scale, gate = (torch.where(pick, p[:b], p[b:]) for p in (shift, scale, gate))
    return adaln_modulate(x, scale, shift), gate


class QwenImageTransformerBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, zero_cond_t: bool) -> None:
        super().__init__()
        self.zero_cond_t = zero_cond_t

        def modulation() -> nn.Sequential:      # split by output, gathered: 1/3 of the weights
            return nn.Sequential(nn.SiLU(), ColumnParallelLinear(dim, 6 * dim, bias=True,
                                                                 gather_output=True))

        self.img_mod = modulation()
        self.attn = QwenImageAttention(dim, num_heads, head_dim)
        self.img_mlp = FeedForward(dim)
        self.txt_mod = modulation()
        self.txt_mlp = FeedForward(dim)

    def forward(self, img: Tensor, txt: Tensor, seq: SequenceSplit, temb: Tensor, rope: Rope,
                mod_index: Tensor | None) -> tuple[Tensor, Tensor]:
        img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)               # (B|2B, 3D) each
        txt_temb = temb.chunk(2, dim=0)[0] if self.zero_cond_t else temb
        txt_mod1, txt_mod2 = self.txt_mod(txt_temb).chunk(2, dim=-1)            # (B, 3D) each
        img_h, img_gate1 = _modulate(img, img_mod1, mod_index)                  # (B, N, D)
        txt_h, txt_gate1 = _modulate(txt, txt_mod1, None)                       # (B, T, D)
        img_attn, txt_attn = self.attn(img_h, txt_h, seq, rope)
        img = gated_add(img, img_attn, img_gate1)
        txt = gated_add(txt, txt_attn, txt_gate1)
        img_h, img_gate2 = _modulate(img, img_mod2, mod_index)
        img = gated_add(img, self.img_mlp(img_h), img_gate2)
        txt_h, txt_gate2 = _modulate(txt, txt_mod2, None)
        txt = gated_add(txt, self.txt_mlp(txt_h), txt_gate2)
        if txt.dtype == torch.float16:
            txt = txt.clip(-65504, 65504)
        if img.dtype == torch.float16:
            img = img.clip(-65504, 65504)
        return txt, img


# ---- model ---------------------------------------------------------------------------------

class QwenImageTransformer2DModel(nn.Module):
    # FP8 (layers/fp8.py): linears left in bf16, besides those too small: the embeddings,
    # the blocks' modulation and the output norm's, the final projection
    fp8_keep = ("time_text_embed.*", "img_in", "txt_in", "*.img_mod.*", "*.txt_mod.*",
                "norm_out.*", "proj_out")

    def __init__(self, cfg: QwenImageTransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim, heads, head_dim = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
        check_heads(heads)
        self.seq_ranks = SequenceRanks.current()
        out_channels = cfg.out_channels or cfg.in_channels
        self.time_text_embed = QwenTimestepProjEmbeddings(dim, cfg.use_additional_t_cond)
        self.txt_norm = RMSNorm(cfg.joint_attention_dim)
        self.img_in = nn.Linear(cfg.in_channels, dim)
        self.txt_in = nn.Linear(cfg.joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList(
            [QwenImageTransformerBlock(dim, heads, head_dim, cfg.zero_cond_t)
             for _ in range(cfg.num_layers)])
        self.norm_out = AdaLayerNormContinuous(dim)
        self.proj_out = nn.Linear(dim, cfg.patch_size ** 2 * out_channels)

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor,
                encoder_hidden_states_mask: Tensor | None, timestep: Tensor,
                img_shapes: ImgShapes, additional_t_cond: Tensor | None = None,
                step_cache: list[CacheGroup] | None = None) -> Tensor:
        """hidden_states (B, N, in_ch) packed latents, N = sum of f*h*w over img_shapes[0];
        encoder_hidden_states (B, T, joint); mask (B, T), 1 = real token (any pattern);
        timestep (B,) in [0, 1]. Returns (B, N, patch^2 * out_ch).
        `step_cache`: per request and branch, skip the blocks on steps whose first modulated
        image input barely moved (layers/step_cache.py); None runs every block.
        Below, T and N count this rank's tokens (all of them with one sequence-parallel rank)."""
        batch, num_txt = encoder_hidden_states.shape[:2]
        mask = _text_mask(encoder_hidden_states_mask, batch, num_txt)
        seq = SequenceSplit.split([num_txt, hidden_states.shape[1]], [mask, None], self.seq_ranks)
        img = self.img_in(seq.local(hidden_states, 1))                            # (B, N, D)
        txt = self.txt_in(self.txt_norm(seq.local(encoder_hidden_states, 0)))    # (B, T, D)
        timestep = timestep.to(img.dtype)
        mod_index = None
        if self.cfg.zero_cond_t:   # first image of each sample is the target, the rest conditions
            timestep = torch.cat([timestep, timestep * 0], dim=0)                 # (2B,)
            mod_index = seq.local(_condition_index(img_shapes, img.device), 1)    # (B, N)
        temb = self.time_text_embed(timestep, img.dtype, additional_t_cond)       # (B|2B, D)
        img_rope, txt_rope = qwen_rope(img_shapes, num_txt, self.cfg.axes_dims_rope, img.device)
        rope = seq.local(img_rope, 1, dim=0), seq.local(txt_rope, 0, dim=0)

        def run_blocks(idx: Tensor | None) -> Tensor:
            i, t, s, e, k = img, txt, seq, temb, mod_index
            if idx is not None:                # rows idx; temb may be [t rows, t=0 rows]
                i, t, s = img[idx], txt[idx], seq.rows(idx)
                e = torch.cat([part[idx] for part in temb.chunk(temb.shape[0] // batch)])
                k = None if mod_index is None else mod_index[idx]
            for block in self.transformer_blocks:
                t, i = block(i, t, s, e, rope, k)
            return i                                                             # (b, N, D)

        if step_cache is None:
            img = run_blocks(None)
        else:
            first = self.transformer_blocks[0]
            img_mod1 = first.img_mod(temb).chunk(2, dim=-1)[0]                   # (B|2B, 3D)
            modulated = _modulate(img, img_mod1, mod_index)[0]                   # (B, N, D)
            img = run_cached(img, modulated, step_cache, TEACACHE_COEFFICIENTS, run_blocks)
        if self.cfg.zero_cond_t:
            temb = temb.chunk(2, dim=0)[0]
        return seq.gather(self.proj_out(self.norm_out(img, temb)), 1)    # (B, all N, out)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> QwenImageTransformer2DModel:
        """Build from a diffusers folder (config.json + safetensors, maybe sharded) in `dtype`
        (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        return build_from_folder(cls, QwenImageTransformerConfig.from_dict(read_config(path)), path, device,
                                 dtype)


def _text_mask(mask: Tensor | None, batch: int, num_txt: int) -> Tensor | None:
    """The caption key mask as bool (B, T), checked against the captions' shape."""
    if mask is None:
        return None
    if mask.shape[:2] != (batch, num_txt):
        raise ValueError(f"encoder_hidden_states_mask shape {tuple(mask.shape)} must be "
                         f"(batch, text_len) = ({batch}, {num_txt})")
    return mask.to(torch.bool)


def _condition_index(img_shapes: ImgShapes, device: torch.device) -> Tensor:
    """zero_cond_t: per image token 0 (the target, first image of a sample) or 1 (a condition
    image) -> (B, N) int; kept per shape on the device, as the rope tables."""
    return _condition_rows(tuple(tuple(tuple(x) for x in s) for s in img_shapes), device)


@functools.lru_cache(maxsize=16)
def _condition_rows(img_shapes: tuple, device: torch.device) -> Tensor:
    return torch.tensor([[0] * math.prod(s[0]) + [1] * sum(math.prod(x) for x in s[1:])
                         for s in img_shapes], device=device, dtype=torch.int)
