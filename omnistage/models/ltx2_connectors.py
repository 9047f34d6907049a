"""LTX-2's text connectors (diffusers' `LTX2TextConnectors`, a pipeline's `connectors/` folder):
what turns Gemma 3's stacked hidden states into the prompt embeddings the LTX-2 transformer
cross-attends to, one stream for video and one for audio.

    hidden states (B, L, D, N)   D = caption_channels, N = text_proj_in_factor (layers + 1)
      LTX-2.0: per layer, over the prompt's tokens: (x - mean) / (max - min) * 8, flattened to
               (B, L, D*N), padding zeroed -> text_proj_in -> (B, L, D), shared by both streams
      LTX-2.3 (per_modality_projections): per token and layer RMS-normed, padding zeroed,
               * sqrt(stream width / D) -> video_text_proj_in, audio_text_proj_in
    -> video_connector, audio_connector: each a small 1D transformer
         padding replaced: the prompt's tokens moved to the front in order, the tail filled
         with the learnable registers of those absolute positions (then nothing is masked);
         without registers, padded keys masked instead
         blocks: RMSNorm -> self-attention (q/k RMSNorm across heads, 1D rope over the whole
         width, optional per-head gates) -> residual, RMSNorm -> GELU(tanh) MLP -> residual
         -> RMSNorm
    -> video (B, L, Dv), audio (B, L, Da), mask (B, L) int64 of ones: what diffusers hands the
       transformer (its mask comes out all ones with or without registers, see forward).

The rope's angle of position p, frequency j is (2 p / rope_base_seq_len - 1) *
theta ** (j / (W/2 - 1)) * pi / 2 over the width W = heads * head_dim; head h takes frequencies
h*hd/2 .. (h+1)*hd/2 - 1, turning interleaved pairs ("interleaved") or the head's two halves
("split"). Every row depends on its own prompt alone, so any prompts batch together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.linear import Linear
from omnistage.models.diffusers_loader import build_from_folder, config_from_dict, read_config

EPS = 1e-6   # every RMSNorm of the connectors, and the normalisations' guard


@dataclass(frozen=True, slots=True)
class LTX2TextConnectorsConfig:
    """diffusers' `LTX2TextConnectors` config.json, its defaults (Gemma-3-12B, LTX-2.0)."""
    caption_channels: int = 3840
    text_proj_in_factor: int = 49
    video_connector_num_attention_heads: int = 30
    video_connector_attention_head_dim: int = 128
    video_connector_num_layers: int = 2
    video_connector_num_learnable_registers: int | None = 128
    video_gated_attn: bool = False
    audio_connector_num_attention_heads: int = 30
    audio_connector_attention_head_dim: int = 128
    audio_connector_num_layers: int = 2
    audio_connector_num_learnable_registers: int | None = 128
    audio_gated_attn: bool = False
    connector_rope_base_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_temporal_positioning: bool = False   # accepted, unused (as in diffusers)
    rope_type: str = "interleaved"
    per_modality_projections: bool = False
    video_hidden_dim: int = 4096
    audio_hidden_dim: int = 2048
    proj_bias: bool = False

    def __post_init__(self) -> None:
        if self.rope_type not in ("interleaved", "split"):
            raise ValueError(f"connectors config rope_type={self.rope_type!r}: 'interleaved' "
                             "or 'split'")
        for stream in ("video", "audio"):
            width = self.stream(stream).width
            expected = (getattr(self, f"{stream}_hidden_dim") if self.per_modality_projections
                        else self.caption_channels)
            if width != expected:
                raise ValueError(f"connectors config: the {stream} connector is {width} wide "
                                 f"(heads * head_dim), its input projection {expected}")

    def stream(self, name: str) -> ConnectorConfig:
        return ConnectorConfig(
            num_heads=getattr(self, f"{name}_connector_num_attention_heads"),
            head_dim=getattr(self, f"{name}_connector_attention_head_dim"),
            num_layers=getattr(self, f"{name}_connector_num_layers"),
            num_registers=getattr(self, f"{name}_connector_num_learnable_registers"),
            gated=getattr(self, f"{name}_gated_attn"),
            rope_base_seq_len=self.connector_rope_base_seq_len, rope_theta=self.rope_theta,
            rope_double_precision=self.rope_double_precision, rope_type=self.rope_type)


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """One stream's connector (video or audio)."""
    num_heads: int
    head_dim: int
    num_layers: int
    num_registers: int | None
    gated: bool
    rope_base_seq_len: int
    rope_theta: float
    rope_double_precision: bool
    rope_type: str

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim


def connector_rope(cfg: ConnectorConfig, seq_len: int, device: torch.device
                   ) -> tuple[Tensor, Tensor]:
    """cos, sin (L, H, hd/2) float32: position p's angles for each head's frequencies."""
    num_freqs = cfg.width // 2
    freq_dtype = torch.float64 if cfg.rope_double_precision else torch.float32
    exponents = torch.linspace(0.0, 1.0, steps=num_freqs, dtype=freq_dtype, device=device)
    freqs = (torch.pow(cfg.rope_theta, exponents) * torch.pi / 2.0).float()   # (W/2,)
    grid = torch.arange(seq_len, dtype=torch.float32, device=device) / cfg.rope_base_seq_len
    angles = (grid[:, None] * 2 - 1) * freqs                                  # (L, W/2)
    angles = angles.view(seq_len, cfg.num_heads, cfg.head_dim // 2)           # (L, H, hd/2)
    return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """x (B, L, H, hd) turned by cos, sin (L, H, hd/2) in float32, back in x's dtype: pairs
    (x0, x1), (x2, x3), ... when interleaved, else (x_i, x_{i+hd/2})."""
    if interleaved:
        x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)                 # (B, L, H, hd/2)
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2).type_as(x)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


def rms_norm(x: Tensor, weight: Tensor | None = None) -> Tensor:
    """torch.nn.RMSNorm's computation (eps 1e-6) over the last axis."""
    return F.rms_norm(x, (x.shape[-1],), weight, EPS)


class ConnectorAttention(nn.Module):
    """diffusers' LTX2Attention as a connector uses it: self-attention, biases on, q and k
    RMS-normed across all heads with a weight, rope on the whole width, optional per-head
    gates 2 * sigmoid(to_gate_logits(x))."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        width = cfg.width
        self.to_q, self.to_k, self.to_v = (Linear(width, width, bias=True) for _ in range(3))
        self.norm_q = nn.Module()
        self.norm_q.weight = nn.Parameter(torch.empty(width), requires_grad=False)
        self.norm_k = nn.Module()
        self.norm_k.weight = nn.Parameter(torch.empty(width), requires_grad=False)
        self.to_out = nn.ModuleList([Linear(width, width, bias=True)])
        self.to_gate_logits = Linear(width, cfg.num_heads, bias=True) if cfg.gated else None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], bias: Tensor | None) -> Tensor:
        B, L, _ = x.shape                                                   # x: (B, L, W)
        heads = (B, L, self.cfg.num_heads, self.cfg.head_dim)
        interleaved = self.cfg.rope_type == "interleaved"
        q = rotate(rms_norm(self.to_q(x), self.norm_q.weight).view(heads), *rope, interleaved)
        k = rotate(rms_norm(self.to_k(x), self.norm_k.weight).view(heads), *rope, interleaved)
        v = self.to_v(x).view(heads)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=bias)  # (B, H, L, hd)
        out = out.transpose(1, 2)                                           # (B, L, H, hd)
        if self.to_gate_logits is not None:
            out = out * (2.0 * torch.sigmoid(self.to_gate_logits(x)))[..., None]
        return self.to_out[0](out.flatten(2))                              # (B, L, W)


class ConnectorFeedForward(nn.Module):
    """diffusers' FeedForward(dim, activation_fn="gelu-approximate"): net.0.proj (W -> 4W),
    GELU (tanh), net.2 (4W -> W); net.1 is a dropout without weights."""

    def __init__(self, width: int) -> None:
        super().__init__()
        first = nn.Module()
        first.proj = Linear(width, 4 * width, bias=True)
        self.net = nn.ModuleList([first, nn.Identity(), Linear(4 * width, width, bias=True)])

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate="tanh"))


class ConnectorBlock(nn.Module):
    def __init__(self, cfg: ConnectorConfig) -> None:
        super().__init__()
        self.attn1 = ConnectorAttention(cfg)
        self.ff = ConnectorFeedForward(cfg.width)

    def forward(self, h: Tensor, rope: tuple[Tensor, Tensor], bias: Tensor | None) -> Tensor:
        h = h + self.attn1(rms_norm(h), rope, bias)
        return h + self.ff(rms_norm(h))


class ConnectorTransformer1d(nn.Module):
    """One stream's connector: registers in place of padding, blocks, output RMSNorm."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.learnable_registers = (
            None if cfg.num_registers is None
            else nn.Parameter(torch.empty(cfg.num_registers, cfg.width), requires_grad=False))
        self.transformer_blocks = nn.ModuleList(ConnectorBlock(cfg)
                                                for _ in range(cfg.num_layers))

    def fill_registers(self, h: Tensor, valid: Tensor) -> Tensor:
        """The prompt's rows moved to the front in order (a stable sort of the mask), the
        rows after them the registers of their absolute positions (position p: register
        p mod R)."""
        B, L, W = h.shape
        num_registers = self.cfg.num_registers
        if L % num_registers:
            raise ValueError(f"max_sequence_length: {L} tokens, but the connectors' "
                             f"{num_registers} learnable registers need a multiple of "
                             f"{num_registers}")
        order = torch.argsort((~valid).to(torch.int32), dim=1, stable=True)  # (B, L)
        front = torch.gather(h, 1, order[..., None].expand(-1, -1, W))
        num_valid = valid.sum(dim=1, keepdim=True)                          # (B, 1)
        is_front = torch.arange(L, device=h.device)[None, :] < num_valid    # (B, L)
        registers = self.learnable_registers.repeat(L // num_registers, 1)  # (L, W)
        return torch.where(is_front[..., None], front, registers.to(h.dtype)[None])

    def forward(self, h: Tensor, valid: Tensor) -> Tensor:
        """h (B, L, W), valid (B, L) bool -> (B, L, W)."""
        if self.learnable_registers is not None:
            h, bias = self.fill_registers(h, valid), None
        else:   # padded keys masked additively, as diffusers masks them
            bias = (valid.to(torch.int64) - 1).to(h.dtype)[:, None, None, :]
            bias = bias * torch.finfo(h.dtype).max                          # (B, 1, 1, L)
        rope = connector_rope(self.cfg, h.shape[1], h.device)
        for block in self.transformer_blocks:
            h = block(h, rope, bias)
        return rms_norm(h)


def masked_range_norm(x: Tensor, lengths: Tensor, left_padded: bool,
                      scale: float = 8.0) -> Tensor:
    """LTX-2.0's feature normalisation: x (B, L, D, N); for each row and layer, over the
    prompt's positions (the last `lengths` when left-padded, else the first):
    (x - mean) / (max - min + eps) * scale, flattened to (B, L, D*N), padding rows 0. The
    operations and their dtypes are diffusers' (sum, min, max in x's dtype; the rest float32)."""
    B, L, D, _ = x.shape
    pos = torch.arange(L, device=x.device)[None, :]
    valid = pos >= L - lengths[:, None] if left_padded else pos < lengths[:, None]  # (B, L)
    keep = valid[:, :, None, None]
    mean = (x.masked_fill(~keep, 0.0).sum(dim=(1, 2), keepdim=True)
            / ((lengths * D).view(B, 1, 1, 1) + EPS))                       # (B, 1, 1, N)
    lo = x.masked_fill(~keep, float("inf")).amin(dim=(1, 2), keepdim=True)
    hi = x.masked_fill(~keep, float("-inf")).amax(dim=(1, 2), keepdim=True)
    normed = x - mean                      # float32 (B, L, D, N); then in place, the same
    normed.div_(hi - lo + EPS).mul_(scale)  # arithmetic with one float32 copy alive, not three
    normed = normed.flatten(2).masked_fill_(~valid[..., None], 0.0)         # (B, L, D*N)
    return normed.to(x.dtype)


class LTX2TextConnectors(nn.Module):
    def __init__(self, config: LTX2TextConnectorsConfig) -> None:
        super().__init__()
        self.config = config
        in_width = config.caption_channels * config.text_proj_in_factor
        if config.per_modality_projections:
            self.video_text_proj_in = Linear(in_width, config.video_hidden_dim,
                                             bias=config.proj_bias)
            self.audio_text_proj_in = Linear(in_width, config.audio_hidden_dim,
                                             bias=config.proj_bias)
        else:
            self.text_proj_in = Linear(in_width, config.caption_channels, bias=config.proj_bias)
        self.video_connector = ConnectorTransformer1d(config.stream("video"))
        self.audio_connector = ConnectorTransformer1d(config.stream("audio"))

    @property
    def sequence_multiple(self) -> int:
        """What max_sequence_length must be a multiple of: both streams' register counts (1
        without registers), for a pipeline to check a request before it is encoded."""
        counts = [self.config.stream(s).num_registers or 1 for s in ("video", "audio")]
        return math.lcm(*counts)

    def project(self, hidden: Tensor, mask: Tensor, left_padded: bool) -> tuple[Tensor, Tensor]:
        """Stacked hidden states (B, L, D, N) -> each stream's connector input."""
        cfg = self.config
        if not cfg.per_modality_projections:   # LTX-2.0
            text = self.text_proj_in(masked_range_norm(hidden, mask.sum(dim=-1), left_padded))
            return text, text
        normed = hidden * torch.rsqrt(torch.mean(hidden ** 2, dim=2, keepdim=True) + EPS)
        normed = normed.flatten(2, 3)                                       # (B, L, D*N)
        normed = torch.where(mask.bool()[..., None], normed, torch.zeros_like(normed))
        video = normed * math.sqrt(cfg.video_hidden_dim / cfg.caption_channels)
        audio = normed * math.sqrt(cfg.audio_hidden_dim / cfg.caption_channels)
        return self.video_text_proj_in(video), self.audio_text_proj_in(audio)

    def forward(self, hidden: Tensor, mask: Tensor, left_padded: bool = True
                ) -> tuple[Tensor, Tensor, Tensor]:
        """hidden (B, L, D, N) or (B, L, D*N), as Gemma's hidden states stacked on the last
        axis; mask (B, L), 1 = token -> video (B, L, Dv), audio (B, L, Da), mask (B, L)
        int64: what diffusers' LTX2TextConnectors.forward returns (padding_side "left" when
        left_padded, else "right")."""
        cfg = self.config
        if hidden.dim() == 3:
            hidden = hidden.unflatten(2, (cfg.caption_channels, -1))
        expected = (cfg.caption_channels, cfg.text_proj_in_factor)
        if tuple(hidden.shape[2:]) != expected:
            raise ValueError(f"hidden states: (B, L, {expected[0]}, {expected[1]}) expected "
                             f"(caption_channels, text_proj_in_factor), got "
                             f"{tuple(hidden.shape)}")
        video, audio = self.project(hidden, mask, left_padded)
        valid = mask.bool()
        video = self.video_connector(video, valid)
        audio = self.audio_connector(audio, valid)
        # diffusers binarises the video connector's additive mask with `< 1e-6`, true of 0
        # (registers, or a token) and of -max (padding) alike: the mask handed on is all ones
        # and nothing is zeroed, with or without registers. Kept so, to hand the same.
        return video, audio, torch.ones_like(mask, dtype=torch.int64)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> LTX2TextConnectors:
        """A diffusers `connectors/` folder (config.json + diffusion_pytorch_model
        safetensors) in `dtype` (None: the checkpoint's); bad tensors raise ValueError."""
        path = Path(path)
        config = config_from_dict(LTX2TextConnectorsConfig, read_config(path),
                                  "LTX2TextConnectors")
        return build_from_folder(cls, config, path, device, dtype)
