"""CLIP vision encoder: transformers' `CLIPVisionModel` in plain PyTorch, up to the hidden state a
pipeline reads (Wan2.1 image-to-video's `image_encoder/`: hidden_states[-2]).

    pixel_values (B,3,S,S) -> patch conv (p x p, stride p) -> [class token | S/p x S/p patches]
    + position embedding -> pre_layrnorm -> k x pre-LN block (full SDPA, fc1 -> act -> fc2)
    -> (B, 1 + (S/p)^2, D)

transformers' hidden_states[i] is the input of layer i (hidden_states[0] the embeddings after
pre_layrnorm, hidden_states[-1] the last layer's output, before any post_layernorm), so
hidden_states[-2] is the output of all layers but the last. We build only the layers that
hidden state needs (k = num_hidden_layers + 1 + hidden_layer); the layers after it and
post_layernorm (which only the pooled output sees) are skipped at loading, by name. The layers
are the text tower's (text_encoders/clip.py), without the causal mask. Checkpoints written
before transformers 5 prefix names with "vision_model.", which loading drops.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from omnistage.models.text_encoders.clip import CLIPEncoder
from omnistage.models.text_encoders.common import (build_on, checkpoint_dtype, get_activation,
                                                   load_weights_strict, read_hf_config,
                                                   strip_prefix)

PENULTIMATE = -2                   # Wan2.1 I2V's image tokens: hidden_states[-2]
# Checkpoint tensors never loaded: the pooled output's norm, and the saved position-ids buffer.
IGNORED = ("post_layernorm.", "embeddings.position_ids")


@dataclass(frozen=True, slots=True)
class CLIPVisionConfig:
    """The vision tower's sizes, read from config.json (SigLIP's: siglip_vision.py)."""

    MODEL_TYPE: ClassVar[tuple[str, str]] = ("clip_vision_model", "CLIP")
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1          # patches + class token

    @classmethod
    def from_hf(cls, hf: PretrainedConfig) -> CLIPVisionConfig:
        hf = getattr(hf, "vision_config", hf)     # a full config holds it in vision_config
        model_type, name = cls.MODEL_TYPE
        if hf.model_type != model_type:
            raise ValueError(f"config.json model_type {hf.model_type!r}: not a {name} vision "
                             "model")
        if hf.hidden_size % hf.num_attention_heads:
            raise ValueError(f"config.json hidden_size={hf.hidden_size} is not a multiple of "
                             f"num_attention_heads={hf.num_attention_heads}")
        get_activation(hf.hidden_act, "hidden_act")
        return cls(hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                   num_hidden_layers=hf.num_hidden_layers,
                   num_attention_heads=hf.num_attention_heads, num_channels=hf.num_channels,
                   image_size=hf.image_size, patch_size=hf.patch_size, hidden_act=hf.hidden_act,
                   layer_norm_eps=hf.layer_norm_eps)


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: CLIPVisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(d))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, d, cfg.patch_size,
                                         stride=cfg.patch_size, bias=False)
        self.position_embedding = nn.Embedding(cfg.num_positions, d,
                                               _weight=torch.empty(cfg.num_positions, d))

    def forward(self, pixel_values: Tensor) -> Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))      # (B, D, g, g)
        patches = patches.flatten(2).transpose(1, 2)                        # (B, g*g, D)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)         # (B, 1, D)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # (B, 1+g*g, D)


class CLIPVisionEncoder(nn.Module):
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v")}

    def __init__(self, config: CLIPVisionConfig, num_layers: int) -> None:
        super().__init__()
        if not 0 <= num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers={num_layers}: the checkpoint has "
                             f"{config.num_hidden_layers}")
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config, num_layers, causal=False)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """pixel_values (B, 3, S, S), normalized as CLIPImageProcessor makes them -> the hidden
        state after this encoder's layers (B, 1 + (S/p)^2, D)."""
        size = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[2:]) != (size, size):
            raise ValueError(f"pixel_values: expected (B, {self.config.num_channels}, {size}, "
                             f"{size}), got {tuple(pixel_values.shape)}")
        h = self.pre_layrnorm(self.embeddings(pixel_values))
        return self.encoder(h, None)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None, hidden_layer: int = PENULTIMATE
                        ) -> CLIPVisionEncoder:
        """Build from a transformers `CLIPVisionModel` folder in `dtype` (None: the
        checkpoint's), with the layers up to transformers' hidden_states[hidden_layer].
        Missing, unexpected or mis-shaped tensors raise ValueError; only post_layernorm, the
        position-ids buffer and the layers past `hidden_layer` are skipped."""
        path = Path(path)
        config = CLIPVisionConfig.from_hf(read_hf_config(path))
        num_layers = hidden_layer % (config.num_hidden_layers + 1)
        model = build_on(lambda c: cls(c, num_layers), config, device,
                         dtype or checkpoint_dtype(path))
        unused = re.compile(r"encoder\.layers\.(\d+)\.")

        def rename(name: str) -> str:
            name = strip_prefix(name, ("vision_model.",))
            layer = unused.match(name)
            return "unused." + name if layer and int(layer[1]) >= num_layers else name

        load_weights_strict(model, path, rename, ignored_prefixes=(*IGNORED, "unused."),
                            packed_modules=cls.packed_modules)
        return model.eval().requires_grad_(False)
