"""A Qwen2 / Qwen3 / Qwen2.5-VL text decoder run as a prompt encoder: one forward over a padded
batch, no KV cache, returning the hidden states a diffusion pipeline conditions on (Z-Image:
Qwen3, hidden_states[-2]; Qwen-Image: Qwen2.5-VL's language model, hidden_states[-1]; FLUX.2
klein: Qwen3, layers 9, 18, 27). Mistral (FLUX.2-dev's Mistral-3 language model) is the same
decoder without biases or qk-norm, and runs here too.

    input_ids (B,S) -> embed_tokens -> layer 1 .. layer L -> norm
    hidden states:  0 (embeddings)  1 .. L-1 (layer outputs)  L (after the final norm)

numbered as HF's `output_hidden_states` (so -1 = L is after the final norm and -2 = L-1 is the
output of the second-to-last layer, never the raw output of the last layer). Layers past the
deepest one requested are not run.

Attention is causal plus the key-padding mask, in SDPA; positions are 0..S-1 for every row
whatever the padding, as HF numbers them when given only input_ids and a mask. Qwen2.5-VL's
multimodal rotary splits the rotary frequencies into (temporal, height, width) sections, each
taking its own position id; a text token has the same id on all three axes, so for text-only
input it is the ordinary 1D rotary over the whole head. With images (Qwen-Image-Edit) the caller
passes the merged input embeddings and the (3, B, S) positions of the image tokens' grid.

Checkpoints: a bare Qwen3Model / Qwen2Model folder (`layers.*`), a *ForCausalLM folder
(`model.*` + `lm_head`), a Qwen2_5_VLForConditionalGeneration folder (`model.*` or
`model.language_model.*`, plus `visual.*` / `model.visual.*` and `lm_head`), or a
Mistral3ForConditionalGeneration folder (`language_model.model.*` or `model.language_model.*`,
plus the vision tower and projector). LM heads and vision parts are skipped by name
(`IGNORED_PREFIXES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from omnistage.layers.activation import SiluAndMul
from omnistage.layers.linear import Linear, MergedLinear, QKVLinear
from omnistage.layers.norm import RMSNorm
from omnistage.layers.rotary import rotate_half
from omnistage.models.text_encoders.common import (attention_mask_4d, build_on, checkpoint_dtype,
                                                   load_weights_strict, read_hf_config,
                                                   strip_prefix)

# Checkpoint prefixes of the decoder itself, tried in order, and what an encoder skips.
DECODER_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
IGNORED_PREFIXES = ("lm_head.", "visual.", "language_model.lm_head.", "vision_tower.",
                    "multi_modal_projector.")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # old checkpoints saved the rotary buffer

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen2_5_vl_text", "mistral")
Rope = tuple[Tensor, Tensor]   # cos, sin: (S, head_dim) each, in the activations' dtype


@dataclass(frozen=True, slots=True)
class QwenTextConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    o_proj_bias: bool
    has_qk_norm: bool
    mrope_section: tuple[int, ...] | None = None    # Qwen2.5-VL: rotary pairs per (t, h, w)

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig) -> QwenTextConfig:
        hf = hf_config.get_text_config()   # Qwen2.5-VL: the language model's part
        model_type = hf.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type {model_type!r}: not a supported Qwen (or "
                             f"Mistral) text model ({', '.join(SUPPORTED_MODEL_TYPES)})")
        if hf.hidden_act != "silu":
            raise ValueError(f"config.json hidden_act={hf.hidden_act!r}: Qwen uses 'silu'")
        if "sliding_attention" in (getattr(hf, "layer_types", None) or ()) or (
                model_type == "mistral" and getattr(hf, "sliding_window", None)):
            raise NotImplementedError("config.json layer_types: sliding-window attention layers "
                                      "(use_sliding_window) are not supported")
        rope = dict(hf.rope_parameters)
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"config.json rope_parameters {rope}: only the default "
                                      "rotary (plain or multimodal) is supported")
        num_heads = hf.num_attention_heads
        head_dim = hf.hidden_size // num_heads
        if model_type != "qwen2_5_vl_text":   # Qwen2.5-VL ignores a head_dim entry
            head_dim = getattr(hf, "head_dim", None) or head_dim
        is_qwen3 = model_type == "qwen3"
        is_qwen2 = model_type in ("qwen2", "qwen2_5_vl_text")
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(model_type=model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                   intermediate_size=hf.intermediate_size,
                   num_hidden_layers=hf.num_hidden_layers, num_attention_heads=num_heads,
                   num_key_value_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
                   head_dim=head_dim, rms_norm_eps=hf.rms_norm_eps,
                   rope_theta=float(rope["rope_theta"]),
                   qkv_bias=is_qwen2 or attention_bias,   # Qwen2: always on q/k/v; Mistral: never
                   o_proj_bias=attention_bias if is_qwen3 else False,
                   has_qk_norm=is_qwen3,
                   mrope_section=tuple(rope["mrope_section"]) if "mrope_section" in rope
                   else None)


def apply_rope(x: Tensor, rope: Rope) -> Tensor:
    """Rotate-half rotary on x: (B, H, S, hd)."""
    cos, sin = rope
    return x * cos + rotate_half(x) * sin


class QwenAttention(nn.Module):
    def __init__(self, cfg: QwenTextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.qkv_sizes = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, self.num_heads,
                                  self.num_kv_heads, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.has_qk_norm = cfg.has_qk_norm
        if self.has_qk_norm:   # Qwen3: RMSNorm over each head of q and k, before rotary
            self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def forward(self, x: Tensor, rope: Rope, mask: Tensor | None) -> Tensor:
        B, S, _ = x.shape                                                   # x: (B, S, hidden)
        q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q = q.view(B, S, self.num_heads, self.head_dim)                     # (B, S, H, hd)
        k = k.view(B, S, self.num_kv_heads, self.head_dim)                  # (B, S, Hkv, hd)
        v = v.view(B, S, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, heads, S, hd)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:   # GQA: kv head j serves query heads j*groups .. (j+1)*groups-1
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=self.head_dim ** -0.5)   # (B, H, S, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))          # (B, S, hidden)


class QwenMLP(nn.Module):
    def __init__(self, cfg: QwenTextConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))           # (B, S, hidden)


class QwenDecoderLayer(nn.Module):
    def __init__(self, cfg: QwenTextConfig) -> None:
        super().__init__()
        self.self_attn = QwenAttention(cfg)
        self.mlp = QwenMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, h: Tensor, rope: Rope, mask: Tensor | None) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class QwenTextEncoder(nn.Module):
    # checkpoint name -> (our fused parameter, shard id)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: QwenTextConfig) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(QwenDecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # float32 on the host, as HF computes it (not a buffer: `.to(dtype)` must not touch it)
        dims = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device="cpu")
        self.inv_freq_cpu = 1.0 / config.rope_theta ** (dims / config.head_dim)  # (hd/2,)

    def rope(self, seq_len: int, device: torch.device, dtype: torch.dtype,
             position_ids: Tensor | None = None) -> Rope:
        """cos, sin (S, hd) of positions 0..S-1; with multimodal `position_ids` (3, B, S),
        (B, 1, S, hd): the frequency pairs of each mrope_section turn with their own axis."""
        inv_freq = self.inv_freq_cpu.to(device)
        if position_ids is None:
            positions = torch.arange(seq_len, device=device, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]                  # (S, hd/2)
        else:
            sections = self.config.mrope_section
            if sections is None or sum(sections) != inv_freq.numel():
                raise ValueError(f"position_ids: multimodal positions need an mrope_section "
                                 f"summing to {inv_freq.numel()} (config: {sections})")
            axes = position_ids.to(device, torch.float32)[..., None] * inv_freq   # (3, B, S, hd/2)
            freqs = torch.cat([part[i % 3] for i, part in
                               enumerate(axes.split(list(sections), dim=-1))], dim=-1)[:, None]
        emb = torch.cat((freqs, freqs), dim=-1)                             # (..., S, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def layer_index(self, layer: int) -> int:
        """HF hidden-states index (negative counts from the end) -> 0 .. num_layers."""
        num_states = self.num_layers + 1
        if not -num_states <= layer < num_states:
            raise ValueError(f"output_layers: {layer} is outside [-{num_states}, "
                             f"{num_states - 1}] ({self.num_layers} layers + embeddings)")
        return layer % num_states

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                output_layers: tuple[int, ...] = (-1,), inputs_embeds: Tensor | None = None,
                position_ids: Tensor | None = None) -> dict[int, Tensor]:
        """input_ids (B, S), attention_mask (B, S) with 1 = token, 0 = padding (None: none)
        -> {layer: (B, S, hidden)} for each requested layer, keys as given. inputs_embeds
        (B, S, hidden): used instead of the ids' embeddings (image features merged in);
        position_ids (3, B, S): multimodal rotary positions (None: 0..S-1 on every axis)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected (B, S), got {tuple(input_ids.shape)}")
        if not output_layers:
            raise ValueError("output_layers: empty")
        wanted = {layer: self.layer_index(layer) for layer in output_layers}
        deepest = max(wanted.values())
        seq_len = input_ids.shape[1]
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        # h: (B, S, hidden)
        rope = self.rope(seq_len, h.device, h.dtype, position_ids)
        mask = attention_mask_4d(attention_mask, seq_len, causal=True)      # (B, 1, S, S)
        states = {0: h} if 0 in wanted.values() else {}
        for i, layer in enumerate(self.layers[:min(deepest, self.num_layers)], start=1):
            h = layer(h, rope, mask)
            if i in wanted.values() and i < self.num_layers:
                states[i] = h
        if deepest == self.num_layers:
            states[self.num_layers] = self.norm(h)
        return {layer: states[idx] for layer, idx in wanted.items()}

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> QwenTextEncoder:
        """Build from a transformers folder (config.json + safetensors, maybe sharded) in
        `dtype` (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise
        ValueError; only the LM head, the vision tower and saved rotary buffers are skipped."""
        path = Path(path)
        config = QwenTextConfig.from_hf(read_hf_config(path))
        model = build_on(cls, config, device, dtype or checkpoint_dtype(path))
        load_weights_strict(model, path, lambda n: strip_prefix(n, DECODER_PREFIXES),
                            ignored_prefixes=IGNORED_PREFIXES, ignored_suffixes=IGNORED_SUFFIXES,
                            packed_modules=cls.packed_modules)
        return model.eval().requires_grad_(False)
