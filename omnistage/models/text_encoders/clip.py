"""CLIP text encoder: transformers' `CLIPTextModel` (FLUX's `text_encoder/`) and
`CLIPTextModelWithProjection` (SD3's `text_encoder/` and `text_encoder_2/`) in plain PyTorch.

    input_ids (B,S) -> token + position embedding -> num_layers x pre-LN block (causal SDPA,
    fc1 -> quick_gelu / gelu -> fc2) -> final_layer_norm -> last_hidden_state (B,S,D)
    pooled (B,D) = last_hidden_state at each row's end-of-text token
    with projection: pooled (B,P) = text_projection(pooled), HF's `text_embeds`

`hidden_layer` picks another state in place of last_hidden_state, numbered as HF's
`output_hidden_states` (0 = the embeddings, -1 = the last layer's output before the final norm,
-2 = SD3's penultimate layer).

Which token is the end of text follows transformers: configs that still say eos_token_id=2
(the original OpenAI conversions, FLUX's included) take the position of the largest id (the
end-of-text token has the largest id in CLIP's vocabulary); other configs take the first
position holding `eos_token_id`. Parameter names are HF's; checkpoints written before
transformers 5 prefix them with "text_model.", which loading drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from omnistage.layers.linear import Linear, QKVLinear
from omnistage.models.text_encoders.common import (attention_mask_4d, build_on, checkpoint_dtype,
                                                   get_activation, load_weights_strict,
                                                   read_hf_config, strip_prefix)

# Checkpoint tensors we do not load: old transformers saved the position-ids buffer (an arange).
IGNORED = ("embeddings.position_ids",)


@dataclass(frozen=True, slots=True)
class CLIPTextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    hidden_act: str
    layer_norm_eps: float
    eos_token_id: int
    projection_dim: int | None = None     # CLIPTextModelWithProjection: its text_projection

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig) -> CLIPTextConfig:
        hf = hf_config.get_text_config()   # a full CLIPConfig holds the text part in text_config
        if hf.model_type != "clip_text_model":
            raise ValueError(f"config.json model_type {hf.model_type!r}: not a CLIP text model")
        if hf.hidden_size % hf.num_attention_heads:
            raise ValueError(f"config.json hidden_size={hf.hidden_size} is not a multiple of "
                             f"num_attention_heads={hf.num_attention_heads}")
        if not isinstance(hf.eos_token_id, int):
            raise ValueError(f"config.json eos_token_id={hf.eos_token_id!r}: need one token id "
                             "to find the pooled position")
        get_activation(hf.hidden_act, "hidden_act")
        projected = "CLIPTextModelWithProjection" in (hf_config.architectures or ())
        return cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
                   intermediate_size=hf.intermediate_size,
                   num_hidden_layers=hf.num_hidden_layers,
                   num_attention_heads=hf.num_attention_heads,
                   max_position_embeddings=hf.max_position_embeddings, hidden_act=hf.hidden_act,
                   layer_norm_eps=hf.layer_norm_eps, eos_token_id=hf.eos_token_id,
                   projection_dim=hf.projection_dim if projected else None)


class CLIPLayerConfig(Protocol):
    """What the encoder layers read of a CLIP config: the text tower's here, or the vision
    tower's (models/clip_vision.py), which shares these layers."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    hidden_act: str
    layer_norm_eps: float

    @property
    def head_dim(self) -> int: ...


class CLIPAttention(nn.Module):
    """causal: the text tower's; the vision tower attends over every patch."""

    def __init__(self, cfg: CLIPLayerConfig, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                  cfg.num_attention_heads, bias=True)
        self.out_proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        B, S, _ = x.shape                                                   # x: (B, S, D)
        qkv = self.qkv_proj(x).view(B, S, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                                # (B, H, S, hd) x3
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             is_causal=self.causal and mask is None,
                                             scale=self.scale)
        return self.out_proj(out.transpose(1, 2).reshape(B, S, -1))        # (B, S, D)


class CLIPMLP(nn.Module):
    def __init__(self, cfg: CLIPLayerConfig) -> None:
        super().__init__()
        self.act = get_activation(cfg.hidden_act, "hidden_act")
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))                              # (B, S, D)


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg: CLIPLayerConfig, causal: bool = True) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(cfg, causal)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, h: Tensor, mask: Tensor | None) -> Tensor:
        h = h + self.self_attn(self.layer_norm1(h), mask)
        return h + self.mlp(self.layer_norm2(h))


class CLIPTextEmbeddings(nn.Module):
    def __init__(self, cfg: CLIPTextConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                            _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        num_pos = cfg.max_position_embeddings
        self.position_embedding = nn.Embedding(num_pos, cfg.hidden_size,
                                               _weight=torch.empty(num_pos, cfg.hidden_size))

    def forward(self, input_ids: Tensor) -> Tensor:
        seq_len = input_ids.shape[1]
        positions = torch.arange(seq_len, device=input_ids.device)
        return self.token_embedding(input_ids) + self.position_embedding(positions)  # (B, S, D)


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: CLIPLayerConfig, num_layers: int, causal: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg, causal) for _ in range(num_layers))

    def forward(self, h: Tensor, mask: Tensor | None) -> Tensor:
        for layer in self.layers:
            h = layer(h, mask)
        return h

    def hidden_states(self, h: Tensor, mask: Tensor | None) -> list[Tensor]:
        """HF's `hidden_states`: the input, then every layer's output (num_layers + 1)."""
        states = [h]
        for layer in self.layers:
            states.append(layer(states[-1], mask))
        return states


class CLIPTextEncoder(nn.Module):
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v")}

    def __init__(self, config: CLIPTextConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = CLIPTextEmbeddings(config)
        self.encoder = CLIPEncoder(config, config.num_hidden_layers)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if config.projection_dim is not None:
            self.text_projection = Linear(config.hidden_size, config.projection_dim, bias=False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                hidden_layer: int | None = None) -> tuple[Tensor, Tensor]:
        """input_ids (B, S) [, attention_mask (B, S), 1 = token] -> last_hidden_state (B, S, D)
        (or HF's hidden_states[hidden_layer]), pooled (B, D) (projected (B, P) when the
        checkpoint has a text_projection). Attention is causal, so padding after the
        end-of-text token changes nothing before it whether or not the mask is passed (FLUX and
        SD3 pass none)."""
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_position_embeddings:
            raise ValueError(f"input_ids: {seq_len} tokens, more than max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        num_states = self.config.num_hidden_layers + 1
        if hidden_layer is not None and not -num_states <= hidden_layer < num_states:
            raise ValueError(f"hidden_layer={hidden_layer}: outside [-{num_states}, {num_states})")
        mask = attention_mask_4d(attention_mask, seq_len, causal=True)
        states = self.encoder.hidden_states(self.embeddings(input_ids), mask)  # (B, S, D) each
        h = self.final_layer_norm(states[-1])
        pooled = h[torch.arange(h.shape[0], device=h.device), self._eos_positions(input_ids)]
        if hasattr(self, "text_projection"):
            pooled = self.text_projection(pooled)                           # (B, P)
        return (h if hidden_layer is None else states[hidden_layer]), pooled

    def _eos_positions(self, input_ids: Tensor) -> Tensor:
        """(B,) the position of each row's end-of-text token."""
        if self.config.eos_token_id == 2:   # legacy configs: the end-of-text id is the largest
            return input_ids.to(torch.int).argmax(dim=-1)
        # first occurrence (padding may reuse the eos id)
        return (input_ids == self.config.eos_token_id).to(torch.int).argmax(dim=-1)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> CLIPTextEncoder:
        """Build from a transformers folder (config.json + safetensors, maybe sharded) in
        `dtype` (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise
        ValueError; only the tensors in `IGNORED` are skipped."""
        path = Path(path)
        config = CLIPTextConfig.from_hf(read_hf_config(path))
        model = build_on(cls, config, device, dtype or checkpoint_dtype(path))
        load_weights_strict(model, path, lambda n: strip_prefix(n, ("text_model.",)),
                            ignored_prefixes=IGNORED, packed_modules=cls.packed_modules)
        return model.eval().requires_grad_(False)
