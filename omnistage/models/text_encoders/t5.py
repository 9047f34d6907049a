"""T5 encoder: transformers' `T5EncoderModel` in plain PyTorch (FLUX's `text_encoder_2/`,
T5 v1.1 XXL), and the stack UMT5 (umt5.py) shares.

    input_ids (B,S) -> shared embedding -> num_layers x T5Block -> final_layer_norm -> (B,S,D)
    T5Block:  h += SelfAttention(layer_norm(h))    scores = q k^T (no 1/sqrt(d)) + bias
              h += DenseReluDense(layer_norm(h))   v1.0: wo(relu(wi h)); v1.1 (gated-gelu):
                                                   wo(gelu_tanh(wi_0 h) * wi_1 h)

The relative position bias is a heads x buckets table looked up at the (S, S) bucketed
distances, which are computed once per forward. T5 has one table, in block 0, and every block
adds its bias; UMT5 has a table in every block and each block adds its own
(`relative_bias_every_layer`). The layer norm is T5's RMS norm without mean or bias.

Half precision follows transformers: in float16 the `wo` projections stay float32 (HF's
`_keep_in_fp32_modules`), so from the first feed-forward on the residual stream is float32;
wherever the stream is still float16 it is clamped just below the float16 maximum after
each sub-layer, as HF does, against overflow to inf. bfloat16 needs neither.

Parameter names are HF's. `encoder.embed_tokens.weight` is the same tensor as
`shared.weight` (HF ties them) and loads into it; a full T5 checkpoint's decoder and LM head
are skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from omnistage.layers.linear import Linear, MergedLinear, QKVLinear
from omnistage.models.text_encoders.common import (attention_mask_4d, build_on, checkpoint_dtype,
                                                   get_activation, load_weights_strict,
                                                   read_hf_config)

# Checkpoint tensors an encoder does not use (a T5ForConditionalGeneration / T5Model folder).
IGNORED = ("decoder.", "lm_head.")


@dataclass(frozen=True, slots=True)
class T5EncoderConfig:
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_heads: int
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    layer_norm_epsilon: float
    dense_act_fn: str
    is_gated_act: bool
    relative_bias_every_layer: bool      # UMT5: each block its own table; T5: block 0's for all

    @classmethod
    def from_hf(cls, hf: PretrainedConfig, model_types: tuple[str, ...]) -> T5EncoderConfig:
        """`model_types`: the ones the calling encoder loads (T5 and UMT5 checkpoints have the
        same tensors but for the tables, so a wrong one would otherwise fail late or not)."""
        if hf.model_type not in model_types:
            raise ValueError(f"config.json model_type {hf.model_type!r}: not a T5 model this "
                             f"encoder loads (expected {' or '.join(model_types)})")
        get_activation(hf.dense_act_fn, "dense_act_fn")
        return cls(vocab_size=hf.vocab_size, d_model=hf.d_model, d_kv=hf.d_kv, d_ff=hf.d_ff,
                   num_layers=hf.num_layers, num_heads=hf.num_heads,
                   relative_attention_num_buckets=hf.relative_attention_num_buckets,
                   relative_attention_max_distance=hf.relative_attention_max_distance,
                   layer_norm_epsilon=hf.layer_norm_epsilon, dense_act_fn=hf.dense_act_fn,
                   is_gated_act=hf.is_gated_act,
                   relative_bias_every_layer=hf.model_type == "umt5")


def relative_position_bucket(relative_position: Tensor, num_buckets: int, max_distance: int
                             ) -> Tensor:
    """Bidirectional T5 buckets for `key_pos - query_pos`: half the buckets per direction; in
    each half, distances below num_buckets/4 get a bucket each, larger ones share
    logarithmically wider buckets up to `max_distance`, beyond which all share the last."""
    num_buckets //= 2
    bucket = (relative_position > 0).to(torch.long) * num_buckets          # which direction
    distance = relative_position.abs()
    max_exact = num_buckets // 2
    # Same op order as HF (float32 log of distance / max_exact) so bucket edges agree.
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).to(torch.long)
    large = torch.clamp(large, max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


def clamp_fp16(h: Tensor) -> Tensor:
    """HF's guard for float16 streams: clamp to +-max (max - 1000 once an inf appeared)."""
    if h.dtype != torch.float16:
        return h
    big = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(h).any(), big - 1000, big)
    return torch.clamp(h, min=-limit, max=limit)


class T5LayerNorm(nn.Module):
    """RMS norm in float32, cast to the weight's dtype, then scaled (T5 has no mean, no bias)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:                                 # x: (B, S, D)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(self.weight.dtype)


class T5Attention(nn.Module):
    def __init__(self, cfg: T5EncoderConfig, has_relative_attention_bias: bool) -> None:
        super().__init__()
        self.num_heads, self.d_kv = cfg.num_heads, cfg.d_kv
        self.qkv = QKVLinear(cfg.d_model, cfg.d_kv, cfg.num_heads, cfg.num_heads)
        self.o = Linear(cfg.num_heads * cfg.d_kv, cfg.d_model)
        self.has_relative_attention_bias = has_relative_attention_bias
        if has_relative_attention_bias:
            n = cfg.relative_attention_num_buckets
            self.relative_attention_bias = nn.Embedding(n, cfg.num_heads,
                                                        _weight=torch.empty(n, cfg.num_heads))

    def position_bias(self, buckets: Tensor, keep: Tensor | None) -> Tensor:
        """This layer's table at `buckets` (S, S), with the padded keys (`keep` False)
        masked out, as HF adds its mask to every layer's bias."""
        bias = self.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # (1, H, S, S)
        if keep is None:
            return bias
        return torch.where(keep, bias, torch.finfo(bias.dtype).min)          # (B, H, S, S)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        B, S, _ = x.shape                                                    # x: (B, S, D)
        qkv = self.qkv(x).view(B, S, 3, self.num_heads, self.d_kv)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                                 # (B, H, S, d_kv)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(out.transpose(1, 2).reshape(B, S, -1))                 # (B, S, D)


class T5LayerSelfAttention(nn.Module):
    def __init__(self, cfg: T5EncoderConfig, has_relative_attention_bias: bool) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(cfg, has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, h: Tensor, bias: Tensor) -> Tensor:
        return h + self.SelfAttention(self.layer_norm(h), bias)


class T5DenseActDense(nn.Module):
    """v1.0: wo(act(wi x)); v1.1 (gated): wo(act(wi_0 x) * wi_1 x), wi_0 | wi_1 in one matmul."""

    def __init__(self, cfg: T5EncoderConfig) -> None:
        super().__init__()
        self.is_gated = cfg.is_gated_act
        self.act = get_activation(cfg.dense_act_fn, "dense_act_fn")
        if self.is_gated:
            self.wi_01 = MergedLinear(cfg.d_model, [cfg.d_ff, cfg.d_ff])   # | wi_0 | wi_1 |
        else:
            self.wi = Linear(cfg.d_model, cfg.d_ff)
        self.wo = Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:                                  # x: (B, S, D)
        if self.is_gated:
            gate, up = self.wi_01(x).chunk(2, dim=-1)                        # (B, S, d_ff) x2
            h = self.act(gate) * up
        else:
            h = self.act(self.wi(x))
        return self.wo(h.to(self.wo.weight.dtype))   # float32 in float16 models, as HF


class T5LayerFF(nn.Module):
    def __init__(self, cfg: T5EncoderConfig) -> None:
        super().__init__()
        self.DenseReluDense = T5DenseActDense(cfg)
        self.layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.DenseReluDense(self.layer_norm(h))


class T5Block(nn.Module):
    def __init__(self, cfg: T5EncoderConfig, has_relative_attention_bias: bool) -> None:
        super().__init__()
        self.layer = nn.ModuleList([T5LayerSelfAttention(cfg, has_relative_attention_bias),
                                    T5LayerFF(cfg)])

    def forward(self, h: Tensor, bias: Tensor) -> Tensor:
        h = clamp_fp16(self.layer[0](h, bias))
        return clamp_fp16(self.layer[1](h))


class T5Stack(nn.Module):
    def __init__(self, cfg: T5EncoderConfig) -> None:
        super().__init__()
        self.num_buckets = cfg.relative_attention_num_buckets
        self.max_distance = cfg.relative_attention_max_distance
        self.block = nn.ModuleList(
            T5Block(cfg, has_relative_attention_bias=cfg.relative_bias_every_layer or i == 0)
            for i in range(cfg.num_layers))
        self.final_layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, h: Tensor, attention_mask: Tensor | None) -> Tensor:
        S = h.shape[1]
        pos = torch.arange(S, dtype=torch.long, device=h.device)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], self.num_buckets,
                                           self.max_distance)                # (S, S)
        keep = attention_mask_4d(attention_mask, S, causal=False)            # (B, 1, 1, S)
        bias = None
        for block in self.block:
            attn = block.layer[0].SelfAttention
            if attn.has_relative_attention_bias:   # else the last table's bias carries on
                bias = attn.position_bias(buckets, keep)                     # (B|1, H, S, S)
            h = block(h, bias)
        return self.final_layer_norm(h)


class T5Encoder(nn.Module):
    # checkpoint name -> (our fused parameter, shard id)
    packed_modules = {"q": ("qkv", "q"), "k": ("qkv", "k"), "v": ("qkv", "v"),
                      "wi_0": ("wi_01", 0), "wi_1": ("wi_01", 1)}
    model_types: tuple[str, ...] = ("t5", "mt5")   # config.json model_type values it loads

    def __init__(self, config: T5EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model,
                                   _weight=torch.empty(config.vocab_size, config.d_model))
        self.encoder = T5Stack(config)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """input_ids (B, S) [, attention_mask (B, S), 1 = token] -> last_hidden_state (B, S, D).
        Without a mask every position attends everywhere (FLUX pads and passes none)."""
        return self.encoder(self.shared(input_ids), attention_mask)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Self:
        """Build from a transformers folder (config.json + safetensors, maybe sharded) in
        `dtype` (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise
        ValueError; only names under `IGNORED` are skipped."""
        path = Path(path)
        config = T5EncoderConfig.from_hf(read_hf_config(path), cls.model_types)
        dtype = dtype or checkpoint_dtype(path)
        model = build_on(cls, config, device, dtype)
        if dtype == torch.float16:   # HF keeps `wo` in float32 for float16 T5 and UMT5
            for block in model.encoder.block:
                block.layer[1].DenseReluDense.wo.float()

        def rename(name: str) -> str:
            return "shared.weight" if name == "encoder.embed_tokens.weight" else name

        load_weights_strict(model, path, rename, ignored_prefixes=IGNORED,
                            packed_modules=cls.packed_modules)
        return model.eval().requires_grad_(False)
