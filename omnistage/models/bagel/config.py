"""BAGEL's configuration, read from its checkpoint folder as ByteDance-Seed/BAGEL-7B-MoT lays it
out: llm_config.json (Qwen2 with per-head q/k norm and MoT layers), vit_config.json (SigLIP; the
last layer is dropped, as the upstream loader does), ae.safetensors (the FLUX VAE: its shape is
read off the tensors) and, when present, config.json (the Bagel fields the upstream app passes
by hand: latent patch size, latent / ViT grid sides, connector activation)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

# The FLUX VAE's latent normalisation (upstream modeling/autoencoder.py load_ae)
VAE_SCALE_FACTOR = 0.3611
VAE_SHIFT_FACTOR = 0.1159


@dataclass(frozen=True, slots=True)
class BagelLLMConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True, slots=True)
class BagelViTConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int            # vit_config.json's num_hidden_layers - 1 (the upstream drops one)
    num_attention_heads: int
    patch_size: int
    image_size: int
    num_channels: int
    layer_norm_eps: float

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True, slots=True)
class BagelVAEConfig:
    ch: int
    ch_mult: tuple[int, ...]
    num_res_blocks: int
    z_channels: int

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


@dataclass(frozen=True, slots=True)
class BagelConfig:
    llm: BagelLLMConfig
    vit: BagelViTConfig
    vae: BagelVAEConfig
    latent_patch_size: int = 2
    max_latent_size: int = 64              # the upstream app's value
    vit_max_num_patch_per_side: int = 70
    connector_act: str = "gelu_pytorch_tanh"
    timestep_shift: float = 1.0

    @property
    def latent_downsample(self) -> int:
        """Image pixels per latent token side (VAE downsample x latent patch)."""
        return self.vae.downsample * self.latent_patch_size

    @property
    def patch_latent_dim(self) -> int:
        return self.latent_patch_size ** 2 * self.vae.z_channels

    @classmethod
    def from_folder(cls, path: str | Path) -> BagelConfig:
        path = Path(path)
        llm = json.loads((path / "llm_config.json").read_text())
        vit = json.loads((path / "vit_config.json").read_text())
        top = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() \
            else {}
        if top.get("interpolate_pos", False):
            raise NotImplementedError("config.json interpolate_pos=true: only the extrapolated "
                                      "position ids of the released checkpoint are supported")
        if (llm.get("rope_scaling") or {}).get("rope_type", "default") != "default":
            raise NotImplementedError(f"llm_config.json rope_scaling {llm['rope_scaling']}")
        llm_cfg = BagelLLMConfig(
            vocab_size=llm["vocab_size"], hidden_size=llm["hidden_size"],
            intermediate_size=llm["intermediate_size"],
            num_hidden_layers=llm["num_hidden_layers"],
            num_attention_heads=llm["num_attention_heads"],
            num_key_value_heads=llm.get("num_key_value_heads", llm["num_attention_heads"]),
            rms_norm_eps=llm.get("rms_norm_eps", 1e-6), rope_theta=llm.get("rope_theta", 1e4),
            max_position_embeddings=llm.get("max_position_embeddings", 32768))
        vit_cfg = BagelViTConfig(
            hidden_size=vit["hidden_size"], intermediate_size=vit["intermediate_size"],
            num_layers=vit["num_hidden_layers"] - 1,
            num_attention_heads=vit["num_attention_heads"], patch_size=vit["patch_size"],
            image_size=vit["image_size"], num_channels=vit.get("num_channels", 3),
            layer_norm_eps=vit.get("layer_norm_eps", 1e-6))
        keys = {k: top[k] for k in ("latent_patch_size", "max_latent_size",
                                    "vit_max_num_patch_per_side", "connector_act",
                                    "timestep_shift") if k in top}
        return cls(llm=llm_cfg, vit=vit_cfg, vae=vae_config(path / "ae.safetensors"), **keys)


def vae_config(file: Path) -> BagelVAEConfig:
    """The VAE's widths off its tensors (the upstream hard-codes the FLUX VAE's)."""
    with safe_open(str(file), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    ch = shapes["encoder.conv_in.weight"][0]
    levels = sorted({int(k.split(".")[2]) for k in shapes if k.startswith("encoder.down.")})
    ch_mult = tuple(shapes[f"encoder.down.{i}.block.0.conv1.weight"][0] // ch for i in levels)
    num_res = len({k.split(".")[4] for k in shapes if k.startswith("encoder.down.0.block.")})
    return BagelVAEConfig(ch=ch, ch_mult=ch_mult, num_res_blocks=num_res,
                          z_channels=shapes["decoder.conv_in.weight"][1])
