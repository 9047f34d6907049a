"""Gemma 3's language model run as a prompt encoder: one forward over a padded batch, no KV
cache, every hidden state kept (LTX-2's `text_encoder/`, a Gemma3ForConditionalGeneration of
which only the language model runs: diffusers' LTX2Pipeline stacks all of its hidden states).

    input_ids (B,S) -> embed_tokens * sqrt(hidden) -> layer 1 .. layer L -> norm
    hidden states:  0 (scaled embeddings)  1 .. L-1 (layer outputs)  L (after the final norm)

numbered as HF's `output_hidden_states`, and returned stacked on the last axis, (B, S, hidden,
L+1), the layout `torch.stack(hidden_states, dim=-1)` gives.

What makes it Gemma and not Qwen (qwen.py):
  - RMSNorm scales by (1 + weight), in float32, and rounds once after the scale;
  - four norms per layer: around attention (input_, post_attention_) and around the MLP
    (pre_feedforward_, post_feedforward_): h + post_norm(block(pre_norm(h)));
  - q/k RMSNorm per head; scores scaled by query_pre_attn_scalar ** -0.5, not head_dim's;
  - layers alternate sliding-window (a key at most sliding_window-1 positions back) and full
    attention (`layer_types`), each kind with its own rotary (rope_parameters[kind]: theta,
    and "linear" scaling: Gemma-3-12B's full layers divide the frequencies by 8);
  - the MLP is gelu(tanh)(gate) * up.

Attention is causal plus the key-padding mask in SDPA; positions are 0..S-1 for every row
whatever the padding (LTX-2 pads on the left), as HF numbers them when given only input_ids
and a mask. A padding query that would see no key at all sees itself (see attention_masks):
padding rows differ from HF's, which no caller reads; every real token's row is HF's.

Checkpoints: a Gemma3ForConditionalGeneration folder (`model.language_model.*`, older saves
`language_model.model.*`, plus the vision tower, the projector, maybe `lm_head`), or a
Gemma3ForCausalLM / Gemma3TextModel folder (`model.*` / bare). Vision parts and LM heads are
skipped by name (`IGNORED_PREFIXES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from omnistage.layers.linear import Linear, MergedLinear, QKVLinear
from omnistage.layers.rotary import rotate_half
from omnistage.models.text_encoders.common import (build_on, checkpoint_dtype, get_activation,
                                                   load_weights_strict, read_hf_config,
                                                   strip_prefix)

DECODER_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
IGNORED_PREFIXES = ("lm_head.", "language_model.lm_head.", "vision_tower.",
                    "multi_modal_projector.")
SUPPORTED_MODEL_TYPES = ("gemma3", "gemma3_text")
LAYER_KINDS = ("sliding_attention", "full_attention")
Rope = tuple[Tensor, Tensor]   # cos, sin: (S, head_dim) each, in the activations' dtype


def _rope_theta_factor(rope: dict, kind: str) -> tuple[float, float]:
    """(theta, linear factor) of one layer kind's rope_parameters entry."""
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "linear"):
        raise NotImplementedError(f"config.json rope_parameters[{kind!r}] rope_type "
                                  f"{rope_type!r}: only 'default' and 'linear' are supported")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError(f"config.json rope_parameters[{kind!r}]: "
                                  "partial_rotary_factor is not supported")
    return float(rope["rope_theta"]), float(rope["factor"]) if rope_type == "linear" else 1.0


@dataclass(frozen=True, slots=True)
class Gemma3TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_activation: str
    rms_norm_eps: float
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope: tuple[tuple[str, float, float], ...]   # (layer kind, theta, linear factor)
    attention_bias: bool
    image_token_id: int | None = None            # ids >= vocab_size HF maps to 0

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig) -> Gemma3TextConfig:
        hf = hf_config.get_text_config()
        if hf_config.model_type not in SUPPORTED_MODEL_TYPES or hf.model_type != "gemma3_text":
            raise ValueError(f"config.json model_type {hf_config.model_type!r}: not a Gemma 3 "
                             f"model ({', '.join(SUPPORTED_MODEL_TYPES)})")
        if getattr(hf, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError("config.json attn_logit_softcapping: not supported")
        if getattr(hf, "use_bidirectional_attention", False):
            raise NotImplementedError("config.json use_bidirectional_attention: not supported")
        layer_types = tuple(hf.layer_types)
        unknown = sorted(set(layer_types) - set(LAYER_KINDS))
        if unknown:
            raise NotImplementedError(f"config.json layer_types {unknown}: not supported")
        rope = tuple((kind, *_rope_theta_factor(dict(hf.rope_parameters[kind]), kind))
                     for kind in sorted(set(layer_types)))
        image_token_id = (getattr(hf_config, "image_token_id", None)
                          if hf_config.model_type == "gemma3" else None)
        return cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                   intermediate_size=hf.intermediate_size,
                   num_hidden_layers=hf.num_hidden_layers,
                   num_attention_heads=hf.num_attention_heads,
                   num_key_value_heads=hf.num_key_value_heads, head_dim=hf.head_dim,
                   hidden_activation=hf.hidden_activation, rms_norm_eps=hf.rms_norm_eps,
                   query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
                   sliding_window=int(hf.sliding_window), layer_types=layer_types, rope=rope,
                   attention_bias=bool(hf.attention_bias), image_token_id=image_token_id)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, rounded to x's dtype once at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:                                  # x: (..., dim)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.qkv_sizes = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads,
                                  self.num_kv_heads, bias=cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size,
                             bias=cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, rope: Rope, mask: Tensor | None) -> Tensor:
        B, S, _ = x.shape                                                   # x: (B, S, hidden)
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = self.q_norm(q.view(B, S, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, S, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, S, hd)
        cos, sin = rope
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:   # GQA: kv head j serves query heads j*groups .. (j+1)*groups-1
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=self.scale)              # (B, H, S, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))          # (B, S, hidden)


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.act_fn = get_activation(cfg.hidden_activation, "hidden_activation")
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)                      # (B, S, hidden)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(cfg)
        self.mlp = Gemma3MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, h: Tensor, rope: Rope, mask: Tensor | None) -> Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, mask))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def attention_masks(attention_mask: Tensor | None, seq_len: int, sliding_window: int,
                    device: torch.device) -> dict[str, Tensor | None]:
    """Per layer kind, the boolean SDPA mask (B or 1, 1, S, S), True where a query may see a
    key: causal, the key not padding, and for sliding layers the key less than
    `sliding_window` positions back. None where plain causal attention is the whole rule
    (no padding, and no row as long as the window), as HF then runs SDPA's is_causal.

    A left-padded row's padding queries see no key at all under that rule; each is let see
    itself instead, so no SDPA kernel meets a row without keys (some answer NaN there, and a
    NaN value row would reach the real queries through 0 * NaN in the next layer). Rows of
    real tokens are untouched; padding rows are read by no one."""
    pos = torch.arange(seq_len, device=device)
    causal = pos[None, :] <= pos[:, None]                                   # (S, S) [q, k]
    window = causal & (pos[None, :] > pos[:, None] - sliding_window)
    if attention_mask is None or bool(attention_mask.all()):
        return {"full_attention": None,
                "sliding_attention": window[None, None] if seq_len > sliding_window else None}
    keys = attention_mask.bool()[:, None, None, :]                          # (B, 1, 1, S)
    itself = pos[None, :] == pos[:, None]                                   # (S, S)
    return {"full_attention": keys & causal | itself,
            "sliding_attention": keys & window | itself}


class Gemma3TextEncoder(nn.Module):
    # checkpoint name -> (our fused parameter, shard id)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: Gemma3TextConfig) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # float32 on the host, as HF computes them (not buffers: `.to(dtype)` must not touch them)
        dims = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device="cpu")
        self.inv_freq_cpu = {kind: 1.0 / theta ** (dims / config.head_dim) / factor
                             for kind, theta, factor in config.rope}         # (hd/2,) each

    @property
    def hidden_width(self) -> int:
        """Width of one row of the stacked output: hidden_size * (num_layers + 1)."""
        return self.config.hidden_size * (self.num_layers + 1)

    def rope(self, kind: str, seq_len: int, device: torch.device, dtype: torch.dtype) -> Rope:
        """cos, sin (S, hd) of positions 0..S-1 for one layer kind."""
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq_cpu[kind].to(device)[None, :]  # (S, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)                             # (S, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def embed(self, input_ids: Tensor) -> Tensor:
        """Scaled token embeddings (B, S, hidden). The scale sqrt(hidden) is rounded to the
        weights' dtype first, as HF does (bfloat16: sqrt(3840) = 61.97 becomes 62)."""
        image_token_id = self.config.image_token_id
        if image_token_id is not None and image_token_id >= self.config.vocab_size:
            input_ids = input_ids.masked_fill(input_ids == image_token_id, 0)
        weight = self.embed_tokens.weight
        scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32)
        return self.embed_tokens(input_ids) * scale.to(weight.device, weight.dtype)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """input_ids (B, S), attention_mask (B, S) with 1 = token, 0 = padding (None: none)
        -> every hidden state, (B, S, hidden, num_layers + 1): [..., 0] the embeddings,
        [..., i] layer i's output, [..., -1] the last layer's after the final norm."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected (B, S), got {tuple(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: expected {tuple(input_ids.shape)} like "
                             f"input_ids, got {tuple(attention_mask.shape)}")
        B, S = input_ids.shape
        h = self.embed(input_ids)                                           # (B, S, hidden)
        masks = attention_masks(attention_mask, S, self.config.sliding_window, h.device)
        ropes = {kind: self.rope(kind, S, h.device, h.dtype) for kind in self.inv_freq_cpu}
        out = h.new_empty(B, S, self.config.hidden_size, self.num_layers + 1)
        out[..., 0] = h
        for i, (layer, kind) in enumerate(zip(self.layers, self.config.layer_types), start=1):
            h = layer(h, ropes[kind], masks[kind])
            out[..., i] = self.norm(h) if i == self.num_layers else h
        return out

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Gemma3TextEncoder:
        """Build from a transformers folder (config.json + safetensors, maybe sharded) in
        `dtype` (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise
        ValueError; only the vision tower, the projector and the LM head are skipped."""
        path = Path(path)
        config = Gemma3TextConfig.from_hf(read_hf_config(path))
        model = build_on(cls, config, device, dtype or checkpoint_dtype(path))
        load_weights_strict(model, path, lambda n: strip_prefix(n, DECODER_PREFIXES),
                            ignored_prefixes=IGNORED_PREFIXES,
                            packed_modules=cls.packed_modules)
        return model.eval().requires_grad_(False)
