"""SigLIP vision encoder: transformers' `SiglipVisionModel` up to `last_hidden_state`, in plain
PyTorch (HunyuanVideo-1.5 image-to-video's `image_encoder/`, siglip-so400m-patch14-384: 729
image tokens of width 1152).

    pixel_values (B,3,S,S) -> patch conv (p x p, stride p, with bias) -> (S/p)^2 patches
    + position embedding -> k x pre-LN block (full SDPA, fc1 -> gelu-tanh -> fc2)
    -> post_layernorm -> (B, (S/p)^2, D)

No class token; the pooled output's attention-pooling head (`head.*`) is not built and its
tensors are skipped at loading. The layers are CLIP's (text_encoders/clip.py: the same names,
pre-LN with biases), without a mask. Older checkpoints prefix names with "vision_model.",
which loading drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.models.clip_vision import CLIPVisionConfig
from omnistage.models.text_encoders.clip import CLIPEncoder
from omnistage.models.text_encoders.common import (build_on, checkpoint_dtype,
                                                   load_weights_strict, read_hf_config,
                                                   strip_prefix)

# Checkpoint tensors never loaded: the pooling head and the saved position-ids buffer.
IGNORED = ("head.", "embeddings.position_ids")


@dataclass(frozen=True, slots=True)
class SiglipVisionConfig(CLIPVisionConfig):
    """CLIP's vision sizes under SigLIP's model_type; no class token."""

    MODEL_TYPE: ClassVar[tuple[str, str]] = ("siglip_vision_model", "SigLIP")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipVisionConfig) -> None:
        super().__init__()
        d, n = cfg.hidden_size, cfg.num_patches
        self.patch_embedding = nn.Conv2d(cfg.num_channels, d, cfg.patch_size,
                                         stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(n, d, _weight=torch.empty(n, d))

    def forward(self, pixel_values: Tensor) -> Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))      # (B, D, g, g)
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight  # (B, g*g, D)


class SiglipVisionEncoder(nn.Module):
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v")}

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = CLIPEncoder(config, config.num_hidden_layers, causal=False)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """pixel_values (B, 3, S, S), as SiglipImageProcessor makes them -> last_hidden_state
        (B, (S/p)^2, D)."""
        size = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (
                self.config.num_channels, size, size):
            raise ValueError(f"pixel_values: expected (B, {self.config.num_channels}, {size}, "
                             f"{size}), got {tuple(pixel_values.shape)}")
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values), None))

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> SiglipVisionEncoder:
        """Build from a transformers `SiglipVisionModel` folder in `dtype` (None: the
        checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError; only the
        pooling head and the position-ids buffer are skipped."""
        path = Path(path)
        config = SiglipVisionConfig.from_hf(read_hf_config(path))
        model = build_on(cls, config, device, dtype or checkpoint_dtype(path))
        load_weights_strict(model, path, lambda n: strip_prefix(n, ("vision_model.",)),
                            ignored_prefixes=IGNORED, packed_modules=cls.packed_modules)
        return model.eval().requires_grad_(False)
