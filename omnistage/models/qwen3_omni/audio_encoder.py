"""Qwen3-Omni's audio encoder (HF `Qwen3OmniMoeAudioEncoder`) in plain PyTorch, loaded from the
`thinker.audio_tower.*` tensors of the one Qwen3-Omni checkpoint.

    mel (num_mel, total_frames), feature_lens (num_audios,)
      -> split every audio into chunks of 2*n_window frames (the last one shorter)
      -> 3 x [Conv2d 3x3 stride 2 + GELU] over (mel, time) of each chunk, zero-padded to the
         longest chunk of the call -> conv_out -> (chunk, T', d_model)
      -> + sinusoidal positions (restarting at 0 in every chunk), keep each chunk's valid frames
      -> encoder layers, attention inside windows of n_window_infer frames of one audio
      -> ln_post -> proj1 -> GELU -> proj2 -> (num_audio_tokens, output_dim)

One audio of 350 frames with n_window=50, n_window_infer=200 (2 chunks a window):

    chunks   | 100 | 100 | 100 | 50 |      13 + 13 + 13 + 7 tokens
    windows  |    26     |   20    |      attention never crosses a window (nor an audio)

Audios are independent except for one HF quirk we keep: chunks are zero-padded to the longest
chunk of the call, and a chunk's last token sees that padding through the conv biases, so a
lone audio shorter than one chunk encodes slightly differently than beside a longer one.

This file also holds two helpers the vision encoder shares: `varlen_attention` (packed
segments, non-causal, one SDPA call) and `load_prefixed_weights` (strict import of one
component's tensors out of the whole checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.models.loader import (_default_dtype, check_tensor_names, component_dtype,
                                     component_tensor_files, iter_component_tensors)

# ---- checkpoint helpers (shared with vision_encoder.py) -------------------------------------

TensorRewrite = Callable[[Iterator[tuple[str, Tensor]]], Iterator[tuple[str, Tensor]]]


def read_thinker_config(path: Path):
    """The thinker part of `path`/config.json as transformers' config object (a full
    `Qwen3OmniMoeConfig` or a bare thinker config)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model folder)")
    hf_config = AutoConfig.from_pretrained(path)
    return getattr(hf_config, "thinker_config", hf_config)


def load_prefixed_weights(model: nn.Module, path: Path, prefix: str,
                          rewrite: TensorRewrite | None = None) -> None:
    """Copy every checkpoint tensor `prefix`+name into `model`'s parameter `name` (after
    `rewrite`, which may rename or fuse the (name, tensor) stream). Missing, unexpected or
    mis-shaped tensors raise ValueError naming them (with the prefix)."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    tensors = iter_component_tensors(path, prefix)
    with torch.no_grad():
        for name, tensor in (rewrite(tensors) if rewrite is not None else tensors):
            seen.add(prefix + name)
            param = params.get(name)
            if param is None:
                continue        # reported below as unexpected
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {prefix + name!r}: expected shape "
                                 f"{tuple(param.shape)}, got {tuple(tensor.shape)}")
            param.copy_(tensor)
    expected = {prefix + n for n in params}
    check_tensor_names(Path(path), f"{type(model).__name__} ({prefix}*)", expected, seen)


def build_component(model_cls: type[nn.Module], config: object, path: Path, prefix: str,
                    device: torch.device | str, dtype: torch.dtype | None,
                    rewrite: TensorRewrite | None = None) -> nn.Module:
    """`model_cls(config)` on `device` in `dtype` (None: the checkpoint's), built on the meta
    device and filled from the `prefix`* tensors of `path` (through `rewrite`)."""
    files = component_tensor_files(path, prefix)
    with _default_dtype(dtype or component_dtype(files)), torch.device("meta"):
        model = model_cls(config)
    model = model.to_empty(device=device)
    load_prefixed_weights(model, path, prefix, rewrite)
    return model.eval().requires_grad_(False)


# ---- attention over packed segments ---------------------------------------------------------

def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: list[int], scale: float
                     ) -> Tensor:
    """Non-causal attention of packed rows, each segment [cu[i], cu[i+1]) on its own.
    q, k, v: (N, H, D) -> (N, H, D). Segments are gathered into one padded batch and run as
    one SDPA call (no mask when all segments have the same length)."""
    lens = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    assert cu_seqlens[0] == 0 and cu_seqlens[-1] == q.shape[0] and min(lens) > 0, \
        f"cu_seqlens {cu_seqlens} do not cover {q.shape[0]} rows"
    num_segments, max_len = len(lens), max(lens)
    if all(n == max_len for n in lens):
        def split(x: Tensor) -> Tensor:                     # (W, H, L, D)
            return x.view(num_segments, max_len, *x.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(split(q), split(k), split(v), scale=scale)
        return out.transpose(1, 2).reshape(q.shape)
    starts = torch.tensor(cu_seqlens[:-1], device=q.device)
    lens_t = torch.tensor(lens, device=q.device)
    offsets = torch.arange(max_len, device=q.device)
    valid = offsets[None, :] < lens_t[:, None]              # (W, L)
    index = torch.where(valid, starts[:, None] + offsets[None, :], 0)

    def gather(x: Tensor) -> Tensor:                        # (W, H, L, D)
        return x[index].transpose(1, 2)
    out = F.scaled_dot_product_attention(gather(q), gather(k), gather(v),
                                         attn_mask=valid[:, None, None, :], scale=scale)
    return out.transpose(1, 2)[valid]                       # (N, H, D), packed order


# ---- config -----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AudioSizes:
    """What the shared layers read of a Qwen-Omni audio config, with the checks both
    generations need: Qwen3-Omni's config below, Qwen2.5-Omni's (qwen2_5_omni/audio_encoder.py)."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    output_dim: int = 3584
    n_window: int = 50                  # a conv chunk is 2 * n_window mel frames

    def __post_init__(self) -> None:
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"audio_config.d_model {self.d_model} is not a multiple of "
                             f"encoder_attention_heads {self.encoder_attention_heads}")

    @classmethod
    def from_hf(cls, audio_config) -> AudioSizes:
        """From transformers' audio encoder config (thinker_config.audio_config)."""
        act = getattr(audio_config, "activation_function", "gelu")
        if act != "gelu":
            raise ValueError(f"audio_config.activation_function {act!r}: only 'gelu' is supported")
        return cls(**{name: getattr(audio_config, name) for name in cls.__dataclass_fields__})

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window


@dataclass(frozen=True, slots=True)
class AudioEncoderConfig(AudioSizes):
    n_window_infer: int = 800           # an attention window is n_window_infer mel frames
    downsample_hidden_size: int = 480
    conv_chunksize: int = 500           # chunks per conv call (bounds conv activation memory)

    def __post_init__(self) -> None:
        AudioSizes.__post_init__(self)
        if self.n_window_infer < 2 * self.n_window:
            raise ValueError(f"audio_config.n_window_infer {self.n_window_infer} is shorter than "
                             f"one chunk (2 * n_window = {2 * self.n_window})")

    @property
    def window_tokens(self) -> int:
        """Encoder tokens in one attention window (a whole number of full chunks)."""
        return conv_output_length(self.chunk_frames) * (self.n_window_infer // self.chunk_frames)


def checked_feature_lens(input_features: Tensor, feature_lens: Tensor, num_mel_bins: int,
                         min_frames: int = 1) -> list[int]:
    """The audios' mel frame counts, checked against the (num_mel, total_frames) features."""
    lens = feature_lens.tolist()
    if input_features.ndim != 2 or input_features.shape[0] != num_mel_bins:
        raise ValueError(f"input_features: expected ({num_mel_bins}, total_frames), got "
                         f"{tuple(input_features.shape)}")
    if not lens or min(lens) < min_frames or sum(lens) != input_features.shape[1]:
        raise ValueError(f"feature_lens {lens}: every audio needs at least {min_frames} "
                         f"frame(s) and they must sum to the {input_features.shape[1]} given")
    return lens


def chunk_lengths(feature_lens: list[int], chunk: int) -> list[int]:
    """Every audio cut into chunks of `chunk` mel frames, the last one shorter: their lengths."""
    out: list[int] = []
    for n in feature_lens:
        out += [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    return out


def conv_output_length(frames: Tensor | int) -> Tensor | int:
    """Frames left after the three stride-2 convs (kernel 3, padding 1): ceil(x/2) thrice."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def output_lengths(feature_lens: Tensor, n_window: int = 50) -> Tensor:
    """Audio tokens for `feature_lens` mel frames, HF's `_get_feat_extract_output_lengths`:
    13 tokens per full chunk of 100 frames plus the conv output of the tail. (HF writes the 13
    as a constant; we compute it from n_window, which agrees for the released n_window=50.)"""
    chunk = 2 * n_window
    return conv_output_length(feature_lens % chunk) + (feature_lens // chunk) * \
        conv_output_length(chunk)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> Tensor:
    """Whisper's fixed positions: (length, channels) = [sin | cos], float32."""
    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2, dtype=torch.float32))
    scaled = torch.arange(length, dtype=torch.float32)[:, None] * inv_timescales[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


# ---- layers -------------------------------------------------------------------------------------

class AudioAttention(nn.Module):
    """Whisper-style attention; Qwen2.5-Omni's encoder has no k_proj bias (`k_bias=False`)."""

    def __init__(self, cfg: AudioSizes, k_bias: bool = True) -> None:
        super().__init__()
        self.num_heads = cfg.encoder_attention_heads
        self.head_dim = cfg.d_model // cfg.encoder_attention_heads
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=k_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor, cu_seqlens: list[int]) -> Tensor:
        shape = (x.shape[0], self.num_heads, self.head_dim)            # x: (N, d_model)
        q, k, v = (proj(x).view(shape) for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = varlen_attention(q, k, v, cu_seqlens, self.head_dim ** -0.5)  # (N, H, D)
        return self.out_proj(out.reshape(x.shape))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioSizes, k_bias: bool = True) -> None:
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.self_attn = AudioAttention(cfg, k_bias)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)

    def forward(self, x: Tensor, cu_seqlens: list[int]) -> Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), cu_seqlens)
        x = x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:                    # as HF: keep fp16 activations finite
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class AudioEncoder(nn.Module):
    """`forward(input_features (num_mel, total_frames), feature_lens (num_audios,))
    -> (sum of output_lengths(feature_lens), output_dim)`, the audios' tokens in order."""

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        mel_after_conv = conv_output_length(cfg.num_mel_bins)
        self.conv_out = nn.Linear(c * mel_after_conv, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> AudioEncoder:
        """Load `thinker.audio_tower.*` of a Qwen3-Omni checkpoint folder (strict)."""
        cfg = AudioEncoderConfig.from_hf(read_thinker_config(Path(path)).audio_config)
        return build_component(cls, cfg, Path(path), "thinker.audio_tower.", device, dtype)

    def output_lengths(self, feature_lens: Tensor) -> Tensor:
        return output_lengths(feature_lens, self.cfg.n_window)

    def _window_seqlens(self, feature_lens: Tensor) -> list[int]:
        """cu_seqlens of the attention windows: every audio's tokens cut into windows of
        `cfg.window_tokens` (the last one shorter)."""
        window = self.cfg.window_tokens
        cu = [0]
        for n in self.output_lengths(feature_lens).tolist():
            for start in range(0, n, window):
                cu.append(cu[-1] + min(window, n - start))
        return cu

    def forward(self, input_features: Tensor, feature_lens: Tensor) -> Tensor:
        cfg = self.cfg
        lens = checked_feature_lens(input_features, feature_lens, cfg.num_mel_bins)
        chunk_lens = chunk_lengths(lens, cfg.chunk_frames)
        chunks = input_features.to(self.conv2d1.weight.dtype).T.split(chunk_lens)  # (n_i, mel)
        padded = nn.utils.rnn.pad_sequence(chunks, batch_first=True)   # (C, T, mel)
        padded = padded.transpose(1, 2).unsqueeze(1)                   # (C, 1, mel, T)

        embeds = []
        for part in padded.split(cfg.conv_chunksize):
            h = F.gelu(self.conv2d1(part))
            h = F.gelu(self.conv2d2(h))
            embeds.append(F.gelu(self.conv2d3(h)))                     # (c, ch, mel', T')
        h = torch.cat(embeds)
        num_chunks, channels, mel, frames = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(num_chunks, frames, channels * mel))
        h = h + sinusoids(frames, cfg.d_model).to(h)                   # (C, T', d_model)

        valid = torch.arange(frames, device=h.device)[None, :] < \
            conv_output_length(torch.tensor(chunk_lens, device=h.device))[:, None]
        x = h[valid]                                                   # (N, d_model)

        cu_seqlens = self._window_seqlens(feature_lens)
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        x = F.gelu(self.proj1(self.ln_post(x)))
        return self.proj2(x)                                           # (N, output_dim)
