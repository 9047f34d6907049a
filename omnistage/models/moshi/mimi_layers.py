"""Mimi's building blocks, each usable whole or streamed with its own causal state:

    StreamConv            causal Conv1d; streamed (whole strides a call), it keeps the last
                          `(k - 1) * dilation + 1 - stride` inputs (at start: the whole run's
                          left padding, zeros or the first sample repeated)
    StreamConvTranspose   ConvTranspose1d trimmed on the right; streamed, it keeps the
                          `k - stride` overlapping outputs (bias not yet added) for the next call
    MimiTransformer       LayerNorm / GELU layers with layer scale, rope and a sliding-window
                          causal mask; streamed, it keeps the last `sliding_window - 1` keys

A state is a plain dict the caller owns (one per stream), keyed by module; None runs the
whole-clip path, which is what transformers' `MimiModel` computes. Module names follow the
checkpoint's tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.linear import Linear
from omnistage.layers.rotary import RotaryEmbedding, get_rope
from omnistage.models.moshi.config import MimiConfig

State = dict[nn.Module, Tensor]     # each streaming module keeps its own entry


class StreamConv(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int = 1,
                 dilation: int = 1, groups: int = 1, bias: bool = True,
                 mode: str = "constant") -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_ch, out_ch, kernel, stride, dilation=dilation, groups=groups,
                              bias=bias)
        self.kernel = (kernel - 1) * dilation + 1
        self.stride = stride
        self.mode = mode
        self.pad = self.kernel - stride

    def forward(self, x: Tensor, state: State | None = None) -> Tensor:   # (B, C, L)
        if state is None:        # whole clip: left padding, and what completes the last stride
            length = x.shape[-1]
            frames = math.ceil((length - self.kernel + self.pad) / self.stride + 1) - 1
            extra = frames * self.stride + self.kernel - self.pad - length
            return self.conv(F.pad(x, (self.pad, extra), mode=self.mode))
        assert x.shape[-1] % self.stride == 0, (x.shape, self.stride)   # whole strides only
        past = state.get(self)
        if past is None:         # the whole run's left padding: zeros, or the first sample
            past = (x.new_zeros(x.shape[0], x.shape[1], self.pad) if self.mode == "constant"
                    else x[..., :1].expand(-1, -1, self.pad))
        x = torch.cat([past, x], dim=-1)
        state[self] = x[..., x.shape[-1] - self.pad:]
        return self.conv(x)


class StreamConvTranspose(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int, groups: int = 1,
                 bias: bool = True) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_ch, out_ch, kernel, stride, groups=groups, bias=bias)
        self.stride = stride
        self.overlap = kernel - stride                 # trimmed from the right when whole

    def forward(self, x: Tensor, state: State | None = None) -> Tensor:   # (B, C, L)
        y = F.conv_transpose1d(x, self.conv.weight, None, self.stride, groups=self.conv.groups)
        keep = x.shape[-1] * self.stride
        if state is not None:
            tail = state.get(self)
            if tail is not None:
                y = torch.cat([y[..., :self.overlap] + tail, y[..., self.overlap:]], dim=-1)
            state[self] = y[..., keep:]
        y = y[..., :keep]
        bias = self.conv.bias
        return y if bias is None else y + bias[:, None]


class ResnetBlock(nn.Module):
    def __init__(self, cfg: MimiConfig, dim: int, dilation: int) -> None:
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([
            nn.ELU(), StreamConv(dim, hidden, cfg.residual_kernel_size, dilation=dilation),
            nn.ELU(), StreamConv(hidden, dim, 1)])

    def forward(self, x: Tensor, state: State | None = None) -> Tensor:
        h = x
        for layer in self.block:
            h = layer(h, state) if isinstance(layer, StreamConv) else layer(h)
        return x + h


def run_layers(layers: nn.ModuleList, x: Tensor, state: State | None) -> Tensor:
    for layer in layers:
        x = layer(x) if isinstance(layer, nn.ELU) else layer(x, state)
    return x


class SEANetEncoder(nn.Module):
    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [StreamConv(1, cfg.num_filters, cfg.kernel_size)]
        dim = cfg.num_filters
        for ratio in reversed(cfg.upsampling_ratios):
            layers += [ResnetBlock(cfg, dim, cfg.dilation_growth_rate ** j)
                       for j in range(cfg.num_residual_layers)]
            layers += [nn.ELU(), StreamConv(dim, dim * 2, ratio * 2, stride=ratio)]
            dim *= 2
        layers += [nn.ELU(), StreamConv(dim, cfg.hidden_size, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor, state: State | None = None) -> Tensor:   # (B, 1, N) -> latents
        return run_layers(self.layers, x, state)


class SEANetDecoder(nn.Module):
    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        dim = cfg.num_filters * 2 ** len(cfg.upsampling_ratios)
        layers: list[nn.Module] = [StreamConv(cfg.hidden_size, dim, cfg.kernel_size)]
        for ratio in cfg.upsampling_ratios:
            layers += [nn.ELU(), StreamConvTranspose(dim, dim // 2, ratio * 2, ratio)]
            dim //= 2
            layers += [ResnetBlock(cfg, dim, cfg.dilation_growth_rate ** j)
                       for j in range(cfg.num_residual_layers)]
        layers += [nn.ELU(), StreamConv(dim, 1, cfg.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor, state: State | None = None) -> Tensor:   # (B, H, L) -> wav
        return run_layers(self.layers, x, state)


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * x


class MimiAttention(nn.Module):
    def __init__(self, cfg: MimiConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.window = cfg.head_dim, cfg.sliding_window
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size)
        self.rotary = rotary

    def forward(self, x: Tensor, positions: Tensor, state: State | None) -> Tensor:
        b, t, _ = x.shape                                         # x: (B, T, hidden)
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)                       # rotated at their positions
        if state is not None and self in state:
            past = state[self]                                     # (B, P, 2, Hkv, D)
            k = torch.cat([past[:, :, 0], k], dim=1)
            v = torch.cat([past[:, :, 1], v], dim=1)
        num_past = k.shape[1] - t
        q_pos = torch.arange(t, device=x.device)[:, None] + num_past
        k_pos = torch.arange(k.shape[1], device=x.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - self.window)   # (T, P + T)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=self.num_kv_heads != self.num_heads)       # (B, H, T, D)
        if state is not None:                                     # what later rows can see
            state[self] = torch.stack([k, v], dim=2)[:, max(0, k.shape[1] - self.window + 1):]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MimiMLP(nn.Module):
    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MimiTransformerLayer(nn.Module):
    def __init__(self, cfg: MimiConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = MimiAttention(cfg, rotary)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MimiMLP(cfg)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size)

    def forward(self, h: Tensor, positions: Tensor, state: State | None) -> Tensor:
        h = h + self.self_attn_layer_scale(
            self.self_attn(self.input_layernorm(h), positions, state))
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))


class MimiTransformer(nn.Module):
    def __init__(self, cfg: MimiConfig) -> None:
        super().__init__()
        rotary = get_rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.layers = nn.ModuleList(MimiTransformerLayer(cfg, rotary)
                                    for _ in range(cfg.num_hidden_layers))

    def forward(self, h: Tensor, state: State | None = None) -> Tensor:   # (B, T, hidden)
        start = 0
        if state is not None:
            start = int(state.get(self, torch.zeros(())).item())
            state[self] = torch.tensor(start + h.shape[1])
        positions = torch.arange(start, start + h.shape[1], device=h.device)
        for layer in self.layers:
            h = layer(h, positions, state)
        return h
