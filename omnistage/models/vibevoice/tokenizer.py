"""VibeVoice's acoustic and semantic tokenizers: causal 1-D conv stacks (ConvNeXt blocks between
strided convs), the decoder mirroring the encoder with transposed convs. 24 kHz audio, one
latent frame per `hop_length` (3200) samples.

Every conv is causal, so both run streamed exactly: a `ConvState` keeps, per conv, the last
`left_pad` input columns of each row, and a chunk that is a whole number of frames (of
samples) gives the same output as the whole signal. A fresh state is zeros: the whole-signal
case. For a transposed conv (stride s, kernel k) the state holds the last k - 1 input frames;
the output of [state | x] less its right k - s columns ends with the chunk's T * s samples.

Parameter names follow the checkpoint's `model.audio_tower.{encoder,decoder}.*` and
`model.semantic_tokenizer_encoder.*`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.norm import RMSNorm

ConvState = dict[str, Tensor]      # cache key -> (B, C_in, left_pad)


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    channels: int
    hidden_size: int             # the latent width
    kernel_size: int
    num_filters: int
    downsampling_ratios: tuple[int, ...]
    depths: tuple[int, ...]      # the encoder's (stem first); the decoder runs them reversed
    ffn_expansion: int
    rms_norm_eps: float
    vae_std: float = 0.625

    @classmethod
    def from_json(cls, doc: dict) -> TokenizerConfig:
        if doc.get("hidden_act", "gelu") != "gelu":
            raise NotImplementedError(f"tokenizer hidden_act {doc['hidden_act']!r}")
        ratios = tuple(doc.get("downsampling_ratios", (2, 2, 4, 5, 5, 8)))
        depths = tuple(doc.get("depths", (3, 3, 3, 3, 3, 3, 8)))
        if len(depths) != len(ratios) + 1:
            raise ValueError(f"tokenizer depths {depths}: need len(downsampling_ratios) + 1")
        return cls(doc.get("channels", 1), doc.get("hidden_size", 64), doc.get("kernel_size", 7),
                   doc.get("num_filters", 32), ratios, depths, doc.get("ffn_expansion", 4),
                   doc.get("rms_norm_eps", 1e-5), doc.get("vae_std", 0.625))

    @property
    def hop_length(self) -> int:
        return math.prod(self.downsampling_ratios)


class CausalConv1d(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, key: str, stride: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride, groups=groups)
        self.key, self.cin = key, cin
        self.left_pad = kernel - 1 - (stride - 1)
        assert self.left_pad >= 0, (kernel, stride)

    def forward(self, x: Tensor, state: ConvState) -> Tensor:
        return self.conv(_with_context(x, state, self.key, self.left_pad))


class CausalConvTranspose1d(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, key: str, stride: int) -> None:
        super().__init__()
        self.convtr = nn.ConvTranspose1d(cin, cout, kernel, stride)
        self.key, self.cin, self.stride = key, cin, stride
        self.left_pad = kernel - 1
        self.trim = kernel - stride

    def forward(self, x: Tensor, state: ConvState) -> Tensor:
        n_out = x.shape[-1] * self.stride
        y = self.convtr(_with_context(x, state, self.key, self.left_pad))
        if self.trim > 0:
            y = y[..., :-self.trim]
        return y[..., -n_out:]


def _with_context(x: Tensor, state: ConvState, key: str, left_pad: int) -> Tensor:
    """[the state's columns | x], and the state advanced to the last `left_pad` columns."""
    if left_pad == 0:
        return x
    past = state.get(key)
    if past is None:
        past = x.new_zeros(x.shape[0], x.shape[1], left_pad)
    full = torch.cat([past, x], dim=-1)
    state[key] = full[..., -left_pad:]
    return full


class ConvNeXtBlock(nn.Module):
    def __init__(self, cfg: TokenizerConfig, dim: int, idx: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps=cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(dim, eps=cfg.rms_norm_eps)
        self.ffn = nn.Module()
        self.ffn.linear1 = nn.Linear(dim, cfg.ffn_expansion * dim)
        self.ffn.linear2 = nn.Linear(cfg.ffn_expansion * dim, dim)
        self.gamma = nn.Parameter(torch.empty(dim))
        self.ffn_gamma = nn.Parameter(torch.empty(dim))
        self.mixer = CausalConv1d(dim, dim, cfg.kernel_size, f"convnext_layer_{idx}", groups=dim)

    def forward(self, x: Tensor, state: ConvState) -> Tensor:      # x: (B, C, T)
        h = self.mixer(self.norm(x.transpose(1, 2)).transpose(1, 2), state)
        x = x + h * self.gamma[:, None]
        h = self.ffn_norm(x.transpose(1, 2))
        h = self.ffn.linear2(F.gelu(self.ffn.linear1(h))).transpose(1, 2)
        return x + h * self.ffn_gamma[:, None]


class Stage(nn.Module):
    """A (transposed) conv then ConvNeXt blocks; names `conv`/`convtr` and `stage.N`."""

    def __init__(self, conv: nn.Module, blocks: list[ConvNeXtBlock], transposed: bool) -> None:
        super().__init__()
        self.first_name = "convtr" if transposed else "conv"
        setattr(self, self.first_name, conv)
        self.stage = nn.ModuleList(blocks)

    def forward(self, x: Tensor, state: ConvState) -> Tensor:
        x = getattr(self, self.first_name)(x, state)
        for block in self.stage:
            x = block(x, state)
        return x


def _block_ids(depths: tuple[int, ...], i: int) -> list[int]:
    """The reference's cache keys: stage i's blocks are numbered after the earlier stages'
    blocks plus one per stage (a key shared across stages would mix their states)."""
    start = sum(d + 1 for d in depths[:i]) if i else 0
    return list(range(start + 1, start + depths[i] + 1))


class VibeVoiceTokenizerEncoder(nn.Module):
    """Audio (B, channels, N) -> latents (B, N / hop, hidden)."""

    def __init__(self, cfg: TokenizerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        f, d = cfg.num_filters, cfg.depths
        self.stem = Stage(CausalConv1d(cfg.channels, f, cfg.kernel_size, "encoder_stem"),
                          [ConvNeXtBlock(cfg, f, j) for j in _block_ids(d, 0)], False)
        self.conv_layers = nn.ModuleList()
        for i, r in enumerate(cfg.downsampling_ratios):
            cin, cout = f * 2 ** i, f * 2 ** (i + 1)
            conv = CausalConv1d(cin, cout, 2 * r, f"encoder_layer_{i}", stride=r)
            self.conv_layers.append(Stage(conv, [ConvNeXtBlock(cfg, cout, j)
                                                 for j in _block_ids(d, i + 1)], False))
        self.head = CausalConv1d(f * 2 ** len(cfg.downsampling_ratios), cfg.hidden_size,
                                 cfg.kernel_size, "encoder_head")

    def forward(self, audio: Tensor, state: ConvState | None = None) -> Tensor:
        state = {} if state is None else state
        x = self.stem(audio, state)
        for layer in self.conv_layers:
            x = layer(x, state)
        return self.head(x, state).transpose(1, 2)


class VibeVoiceTokenizerDecoder(nn.Module):
    """Latents (B, T, hidden) -> audio (B, channels, T * hop)."""

    def __init__(self, cfg: TokenizerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        f, d = cfg.num_filters, tuple(reversed(cfg.depths))
        n = len(d)
        top = f * 2 ** (n - 1)
        self.stem = Stage(CausalConv1d(cfg.hidden_size, top, cfg.kernel_size, "decoder_stem"),
                          [ConvNeXtBlock(cfg, top, j) for j in _block_ids(d, 0)], False)
        self.conv_layers = nn.ModuleList()
        for i, r in enumerate(reversed(cfg.downsampling_ratios)):
            cin, cout = f * 2 ** (n - 1 - i), f * 2 ** (n - 2 - i)
            conv = CausalConvTranspose1d(cin, cout, 2 * r, f"decoder_layer_{i}", stride=r)
            self.conv_layers.append(Stage(conv, [ConvNeXtBlock(cfg, cout, j)
                                                 for j in _block_ids(d, i + 1)], True))
        self.head = CausalConv1d(f, cfg.channels, cfg.kernel_size, "decoder_head")

    def forward(self, latents: Tensor, state: ConvState | None = None) -> Tensor:
        state = {} if state is None else state
        x = self.stem(latents.transpose(1, 2), state)
        for layer in self.conv_layers:
            x = layer(x, state)
        return self.head(x, state)


def stack_states(states: list[ConvState]) -> ConvState:
    """Per-request states (batch 1 each, or empty: fresh) -> one batched state; the fresh
    rows' columns are zeros."""
    keys = {k for s in states for k in s}
    out: ConvState = {}
    for key in keys:
        ref = next(s[key] for s in states if key in s)
        out[key] = torch.cat([s.get(key, ref.new_zeros(1, *ref.shape[1:])) for s in states])
    return out


def split_state(state: ConvState, n: int) -> list[ConvState]:
    return [{k: v[i:i + 1] for k, v in state.items()} for i in range(n)]
