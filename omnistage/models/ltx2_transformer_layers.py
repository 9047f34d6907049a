"""The LTX-2 transformer's parts below the model (ltx2_transformer.py has the picture): the
positions and rope tables of video and audio tokens, the AdaLN-single time embedding, the
attention (self, text, audio-to-video and video-to-audio) and the audio-video block. Names
follow diffusers' `transformer_ltx2.py` so checkpoint keys map one-to-one."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.dit import FeedForward, TimestepEmbedding, apply_rope, timestep_embedding
from omnistage.layers.norm import RMSNorm
from omnistage.layers.sequence_parallel import sdpa


@dataclass(frozen=True, slots=True)
class Rope:
    """cos, sin float32 for N tokens: "interleaved" (N, D/2), one angle per pair of features
    across all heads; "split" (N, H, hd/2), the first half of each head turned with its second."""
    cos: Tensor
    sin: Tensor
    kind: str

    def __call__(self, x: Tensor) -> Tensor:
        """x (B, N, D) -> x rotated, in x's dtype."""
        if self.kind == "interleaved":
            return apply_rope(x[:, :, None], self.cos, self.sin)[:, :, 0]
        h = self.cos.shape[1]
        first, second = x.float().unflatten(-1, (h, 2, -1)).unbind(-2)        # (B, N, H, r)
        out = torch.stack([first * self.cos - second * self.sin,
                           second * self.cos + first * self.sin], dim=-2)
        return out.flatten(2).type_as(x)


# ---- positions and rope --------------------------------------------------------------------

def video_coords(grid: tuple[int, int, int], patch: tuple[int, int], scale: tuple[int, ...],
                 causal_offset: int, fps: float, device: torch.device) -> Tensor:
    """diffusers' `prepare_video_coords` for one row: (3, N, 2) [start, end) of each token's
    patch in pixel space (frames in seconds: the causal first frame shifted and clamped at 0,
    then over fps), float32. grid: latent (F, H, W); patch: (t, spatial)."""
    pt, p = patch
    axes = [torch.arange(0, n, step, dtype=torch.float32, device=device)
            for n, step in zip(grid, (pt, p, p))]
    start = torch.stack(torch.meshgrid(*axes, indexing="ij"))                    # (3, f, h, w)
    size = torch.tensor((pt, p, p), dtype=torch.float32, device=device).view(3, 1, 1, 1)
    coords = torch.stack([start, start + size], dim=-1).flatten(1, 3)           # (3, N, 2)
    pixel = coords * torch.tensor(scale, device=device).view(3, 1, 1)
    pixel[0] = (pixel[0] + causal_offset - scale[0]).clamp(min=0) / fps
    return pixel


def audio_coords(num_frames: int, patch_t: int, scale: int, causal_offset: int,
                 sample_rate: int, hop_length: int, device: torch.device) -> Tensor:
    """diffusers' `prepare_audio_coords`: (1, L, 2) start and end of each latent audio frame in
    seconds (mel frames back through the VAE's temporal factor, the causal offset)."""
    f = torch.arange(0, num_frames, patch_t, dtype=torch.float32, device=device)

    def seconds(mel_frames: Tensor) -> Tensor:
        return (mel_frames * scale + causal_offset - scale).clip(min=0) * hop_length / sample_rate

    return torch.stack([seconds(f), seconds(f + patch_t)], dim=-1)[None]


def rope_table(coords: Tensor, max_positions: tuple[int, ...], dim: int, theta: float,
               double: bool, kind: str, num_heads: int) -> Rope:
    """diffusers' `LTX2AudioVideoRotaryPosEmbed.forward` for coords (P, N, 2): each token at
    its patch's midpoint over `max_positions`, mapped to [-1, 1], times P x dim // (2P)
    frequencies theta^linspace(0, 1) * pi / 2 (dims interleaved f, h, w), the unused leading
    pairs at angle 0."""
    num_dims = coords.shape[0]
    mid = (coords[..., 0:1] + coords[..., 1:2]) / 2.0
    grid = torch.stack([mid[i, :, 0] / max_positions[i] for i in range(num_dims)], dim=-1)
    steps = dim // (2 * num_dims)
    exps = torch.linspace(0.0, 1.0, steps, dtype=torch.float64 if double else torch.float32,
                          device=coords.device)
    freqs = (torch.pow(theta, exps) * math.pi / 2.0).to(torch.float32)
    angles = ((grid[..., None] * 2 - 1) * freqs).transpose(-1, -2).flatten(1)    # (N, P*steps)
    pad = dim // 2 - angles.shape[1]
    angles = torch.cat([angles.new_zeros(angles.shape[0], pad), angles], dim=1)   # (N, D/2)
    cos, sin = angles.cos(), angles.sin()
    if kind == "split":
        cos, sin = cos.unflatten(1, (num_heads, -1)), sin.unflatten(1, (num_heads, -1))
    return Rope(cos, sin, kind)


# ---- time embedding ------------------------------------------------------------------------

class TimestepSizeEmbedding(nn.Module):
    """diffusers' PixArtAlphaCombinedTimestepSizeEmbeddings without size conditions: the
    256-wide sinusoid (cos first) through timestep_embedder."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)

    def forward(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        return self.timestep_embedder(timestep_embedding(t, 256).to(dtype))


class LTX2AdaLayerNormSingle(nn.Module):
    """t (B, S) -> (linear(silu(emb)) (B, S, k * dim), emb (B, S, dim)): k modulation vectors
    per row (S = 1) or per token."""

    def __init__(self, dim: int, num_mod_params: int) -> None:
        super().__init__()
        self.emb = TimestepSizeEmbedding(dim)
        self.linear = nn.Linear(dim, num_mod_params * dim)

    def forward(self, t: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        emb = self.emb(t.flatten(), dtype)
        return self.linear(F.silu(emb)).unflatten(0, t.shape), emb.unflatten(0, t.shape)


def mod_params(table: Tensor, temb: Tensor) -> list[Tensor]:
    """table (k, D) + temb (B, S, k * D) -> k tensors (B, S, D)."""
    return list((table + temb.unflatten(-1, (table.shape[0], -1))).unbind(2))


# ---- attention and block -------------------------------------------------------------------

class LTX2Attention(nn.Module):
    """q/k RMSNorms over all heads, rope on the whole width before the head split (queries and
    keys may have their own: audio-to-video), an optional gate per head (`gated`)."""

    def __init__(self, query_dim: int, heads: int, head_dim: int, kv_dim: int | None,
                 eps: float, gated: bool) -> None:
        super().__init__()
        inner, kv_dim = heads * head_dim, kv_dim or query_dim
        self.heads = heads
        self.norm_q, self.norm_k = RMSNorm(inner, eps), RMSNorm(inner, eps)
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k, self.to_v = nn.Linear(kv_dim, inner), nn.Linear(kv_dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Identity()])
        self.to_gate_logits = nn.Linear(query_dim, heads) if gated else None

    def forward(self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None,
                q_rope: Rope | None = None, k_rope: Rope | None = None,
                skip: bool = False) -> Tensor:
        """x (B, N, Dq); context (B, L, Dkv) (None: self-attention); mask (B, L) additive.
        skip: the values stand for the attention's output (STG's perturbed pass)."""
        context = x if context is None else context
        if skip:
            out = self.to_v(context).unflatten(-1, (self.heads, -1))
            if self.to_gate_logits is not None:
                out = out * (2.0 * torch.sigmoid(self.to_gate_logits(x)))[..., None]
            return self.to_out[0](out.flatten(2))
        q, k = self.norm_q(self.to_q(x)), self.norm_k(self.to_k(context))
        if q_rope is not None:
            q, k = q_rope(q), (k_rope or q_rope)(k)
        heads = (q.unflatten(-1, (self.heads, -1)), k.unflatten(-1, (self.heads, -1)),
                 self.to_v(context).unflatten(-1, (self.heads, -1)))
        out = sdpa(*heads, mask).type_as(q)                                       # (B, N, H, hd)
        if self.to_gate_logits is not None:
            out = out * (2.0 * torch.sigmoid(self.to_gate_logits(x)))[..., None]
        return self.to_out[0](out.flatten(2))


def rms(x: Tensor, eps: float) -> Tensor:
    """diffusers' RMSNorm without a weight: in float32, back to x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)


@dataclass(frozen=True, slots=True)
class BlockInputs:
    """What every block of one forward shares: text (B, L, D) / (B, L, Da) and their additive
    mask (B, L); modulation inputs temb (B, S, 6D), the cross-modal scale/shift (B, 1, 4D) and
    gate (B, 1, D), each for video and audio; the rope tables; isolate: no a2v / v2a."""
    text: Tensor
    audio_text: Tensor
    mask: Tensor | None
    temb: Tensor
    audio_temb: Tensor
    ca: Tensor
    audio_ca: Tensor
    ca_gate: Tensor
    audio_ca_gate: Tensor
    rope: Rope
    audio_rope: Rope
    ca_rope: Rope
    audio_ca_rope: Rope
    isolate: bool = False

    def rows(self, idx: Tensor) -> BlockInputs:
        """The inputs of some rows of the batch (the ropes are every row's)."""
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[idx]
        return replace(self, **{k: pick(getattr(self, k)) for k in (
            "text", "audio_text", "mask", "temb", "audio_temb", "ca", "audio_ca", "ca_gate",
            "audio_ca_gate")})


class LTX2VideoTransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, cross_dim: int, audio_dim: int,
                 audio_heads: int, audio_head_dim: int, audio_cross_dim: int, eps: float,
                 activation: str, gated: bool, audio_gated: bool) -> None:
        super().__init__()
        self.eps = eps
        self.attn1 = LTX2Attention(dim, heads, head_dim, None, eps, gated)
        self.audio_attn1 = LTX2Attention(audio_dim, audio_heads, audio_head_dim, None, eps,
                                         audio_gated)
        self.attn2 = LTX2Attention(dim, heads, head_dim, cross_dim, eps, gated)
        self.audio_attn2 = LTX2Attention(audio_dim, audio_heads, audio_head_dim,
                                         audio_cross_dim, eps, audio_gated)
        # a2v: video queries over audio keys; v2a: audio over video; both at the audio width
        self.audio_to_video_attn = LTX2Attention(dim, audio_heads, audio_head_dim, audio_dim,
                                                 eps, gated)
        self.video_to_audio_attn = LTX2Attention(audio_dim, audio_heads, audio_head_dim, dim,
                                                 eps, audio_gated)
        self.ff = FeedForward(dim, activation=activation)
        self.audio_ff = FeedForward(audio_dim, activation=activation)
        self.scale_shift_table = nn.Parameter(torch.empty(6, dim))
        self.audio_scale_shift_table = nn.Parameter(torch.empty(6, audio_dim))
        self.video_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.empty(5, dim))
        self.audio_a2v_cross_attn_scale_shift_table = nn.Parameter(torch.empty(5, audio_dim))

    def modulated_inputs(self, x: Tensor, a: Tensor, c: BlockInputs) -> tuple[Tensor, Tensor]:
        """What the self-attentions see, video and audio: what step caching watches."""
        shift, scale = mod_params(self.scale_shift_table, c.temb)[:2]
        a_shift, a_scale = mod_params(self.audio_scale_shift_table, c.audio_temb)[:2]
        return (rms(x, self.eps) * (1 + scale) + shift,
                rms(a, self.eps) * (1 + a_scale) + a_shift)

    def forward(self, x: Tensor, a: Tensor, c: BlockInputs, perturb: bool = False
                ) -> tuple[Tensor, Tensor]:
        """x (B, N, D) video tokens, a (B, M, Da) audio tokens. perturb: both self-attentions
        skipped (their values as output): STG's perturbed pass in this block."""
        shift, scale, gate, shift_ff, scale_ff, gate_ff = mod_params(self.scale_shift_table,
                                                                     c.temb)
        a_shift, a_scale, a_gate, a_shift_ff, a_scale_ff, a_gate_ff = mod_params(
            self.audio_scale_shift_table, c.audio_temb)
        x = x + self.attn1(rms(x, self.eps) * (1 + scale) + shift, q_rope=c.rope,
                           skip=perturb) * gate
        a = a + self.audio_attn1(rms(a, self.eps) * (1 + a_scale) + a_shift,
                                 q_rope=c.audio_rope, skip=perturb) * a_gate
        x = x + self.attn2(rms(x, self.eps), c.text, c.mask)
        a = a + self.audio_attn2(rms(a, self.eps), c.audio_text, c.mask)
        if not c.isolate:
            x, a = self.cross_modal(x, a, c)
        x = x + self.ff(rms(x, self.eps) * (1 + scale_ff) + shift_ff) * gate_ff
        a = a + self.audio_ff(rms(a, self.eps) * (1 + a_scale_ff) + a_shift_ff) * a_gate_ff
        return x, a

    def cross_modal(self, x: Tensor, a: Tensor, c: BlockInputs) -> tuple[Tensor, Tensor]:
        """Audio-to-video, then video-to-audio attention, both from the norms of the streams
        before either (diffusers' order), each side modulated by its own table + the global
        cross-modal scale/shift."""
        nx, na = rms(x, self.eps), rms(a, self.eps)
        v_table, a_table = (self.video_a2v_cross_attn_scale_shift_table,
                            self.audio_a2v_cross_attn_scale_shift_table)
        v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift = mod_params(v_table[:4], c.ca)
        a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = mod_params(a_table[:4], c.audio_ca)
        (a2v_gate,) = mod_params(v_table[4:], c.ca_gate)
        (v2a_gate,) = mod_params(a_table[4:], c.audio_ca_gate)
        x_new = x + a2v_gate * self.audio_to_video_attn(
            nx * (1 + v_a2v_scale) + v_a2v_shift, na * (1 + a_a2v_scale) + a_a2v_shift,
            q_rope=c.ca_rope, k_rope=c.audio_ca_rope)
        a = a + v2a_gate * self.video_to_audio_attn(
            na * (1 + a_v2a_scale) + a_v2a_shift, nx * (1 + v_v2a_scale) + v_v2a_shift,
            q_rope=c.audio_ca_rope, k_rope=c.ca_rope)
        return x_new, a
