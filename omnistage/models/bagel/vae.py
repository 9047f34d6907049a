"""BAGEL's image VAE: the FLUX.1 autoencoder stored in its original (BFL) layout as
ae.safetensors. It is our diffusers-layout `AutoencoderKL` (no quant convs, mid attention on)
with the BFL names mapped on load:

    encoder.down.{i}.block.{j}          -> encoder.down_blocks.{i}.resnets.{j}
    encoder.down.{i}.downsample.conv    -> encoder.down_blocks.{i}.downsamplers.0.conv
    decoder.up.{i}.block.{j}            -> decoder.up_blocks.{n-1-i}.resnets.{j}   (reversed)
    decoder.up.{i}.upsample.conv        -> decoder.up_blocks.{n-1-i}.upsamplers.0.conv
    *.mid.block_1 / attn_1 / block_2    -> *.mid_block.resnets.0 / attentions.0 / resnets.1
    attn q / k / v / proj_out (1x1 conv) -> to_q / to_k / to_v / to_out.0 (Linear)
    nin_shortcut, norm_out              -> conv_shortcut, conv_norm_out
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from omnistage.models.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
from omnistage.models.bagel.config import VAE_SCALE_FACTOR, VAE_SHIFT_FACTOR, BagelVAEConfig

_ATTN = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def kl_config(cfg: BagelVAEConfig) -> AutoencoderKLConfig:
    n = len(cfg.ch_mult)
    return AutoencoderKLConfig(
        down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(cfg.ch * m for m in cfg.ch_mult),
        layers_per_block=cfg.num_res_blocks, latent_channels=cfg.z_channels,
        scaling_factor=VAE_SCALE_FACTOR, shift_factor=VAE_SHIFT_FACTOR,
        use_quant_conv=False, use_post_quant_conv=False)


def bfl_to_diffusers(name: str, num_levels: int) -> str:
    """One ae.safetensors key in our AutoencoderKL's naming."""
    name = re.sub(r"^encoder\.down\.(\d+)\.block\.", r"encoder.down_blocks.\1.resnets.", name)
    name = re.sub(r"^encoder\.down\.(\d+)\.downsample\.", r"encoder.down_blocks.\1.downsamplers.0.",
                  name)

    def up(m: re.Match) -> str:
        return f"decoder.up_blocks.{num_levels - 1 - int(m.group(1))}.{m.group(2)}"
    name = re.sub(r"^decoder\.up\.(\d+)\.(block|upsample)", up, name)
    name = name.replace(".block.", ".resnets.").replace(".upsample.", ".upsamplers.0.")
    name = name.replace("mid.block_1.", "mid_block.resnets.0.")
    name = name.replace("mid.block_2.", "mid_block.resnets.1.")
    m = re.match(r"^(encoder|decoder)\.mid\.attn_1\.(norm|q|k|v|proj_out)\.(weight|bias)$", name)
    if m:
        return f"{m.group(1)}.mid_block.attentions.0.{_ATTN[m.group(2)]}.{m.group(3)}"
    name = name.replace(".nin_shortcut.", ".conv_shortcut.")
    return name.replace(".norm_out.", ".conv_norm_out.")


def load_vae(file: str | Path, cfg: BagelVAEConfig, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32) -> AutoencoderKL:
    vae = AutoencoderKL(kl_config(cfg))
    state: dict[str, Tensor] = {}
    for k, v in load_file(str(file)).items():
        key = bfl_to_diffusers(k, len(cfg.ch_mult))
        if ".attentions.0.to_" in key and key.endswith("weight") and v.dim() == 4:
            v = v[:, :, 0, 0]                                   # 1x1 conv -> Linear
        state[key] = v
    expected = vae.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{file}: missing {missing[:8]}, unexpected {unexpected[:8]}")
    bad = [k for k, v in state.items() if v.shape != expected[k].shape]
    if bad:
        raise ValueError(f"{file}: mis-shaped {[(k, tuple(state[k].shape)) for k in bad[:8]]}")
    vae.load_state_dict(state, strict=True)
    return vae.to(device=device, dtype=dtype).eval()


def diffusers_to_bfl(name: str, num_levels: int) -> str:
    """The inverse of `bfl_to_diffusers` (writing an ae.safetensors from our VAE)."""
    name = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", name)
    name = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.",
                  name)

    def up(m: re.Match) -> str:
        kind = "block." if m.group(2) == "resnets." else "upsample."
        return f"decoder.up.{num_levels - 1 - int(m.group(1))}.{kind}"
    name = re.sub(r"^decoder\.up_blocks\.(\d+)\.(resnets\.|upsamplers\.0\.)", up, name)
    name = name.replace("mid_block.resnets.0.", "mid.block_1.")
    name = name.replace("mid_block.resnets.1.", "mid.block_2.")
    for bfl, ours in _ATTN.items():
        name = name.replace(f"mid_block.attentions.0.{ours}.", f"mid.attn_1.{bfl}.")
    name = name.replace(".conv_shortcut.", ".nin_shortcut.")
    return name.replace(".conv_norm_out.", ".norm_out.")
