"""A tiny random BAGEL checkpoint folder in the layout of ByteDance-Seed/BAGEL-7B-MoT
(config.json naming BagelForConditionalGeneration, llm_config.json, vit_config.json,
ema.safetensors, ae.safetensors in the FLUX VAE's own names, the tokenizer files): what the
BAGEL server tests serve. The shapes are the golden fixtures' (tests/fixtures/bagel/), the
weights random (seeded), the tokenizer the tiny byte-level BPE plus the vision markers.

    LLM   2 MoT layers, hidden 64, 4 heads (2 KV), head 16      ViT  1 layer, patch 4, 32 px
    VAE   32/64 channels, 2x down, 4 latent channels; latent patch 2 -> 4 px a latent token,
          at most 8 tokens a side (32 px images)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from omnistage.models.bagel.config import BagelConfig, BagelVAEConfig, vae_config
from omnistage.models.bagel.model import Bagel
from omnistage.models.bagel.vae import diffusers_to_bfl, kl_config
from omnistage.models.autoencoder_kl import AutoencoderKL
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>"]
LLM = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
           intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, hidden_act="silu", max_position_embeddings=256,
           rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
VIT = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
           num_hidden_layers=2, num_attention_heads=2, num_channels=3, image_size=32,
           patch_size=4, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
TOP = dict(model_type="bagel", architectures=["BagelForConditionalGeneration"],
           latent_patch_size=2, max_latent_size=8, vit_max_num_patch_per_side=8,
           connector_act="gelu_pytorch_tanh", interpolate_pos=False, timestep_shift=1.0)
VAE = BagelVAEConfig(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4)


def _randomize(module: torch.nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sorted(module.state_dict().items()):
        x = torch.randn(t.shape, generator=gen)
        if t.dim() == 1:
            out[name] = 1.0 + 0.1 * x if name.endswith("weight") else 0.05 * x
        else:
            out[name] = x / (t[0].numel() ** 0.5)
    return out


def build_tiny_bagel(path: str | Path, seed: int = 0) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tokenizer.save_pretrained(str(path))
    llm = dict(LLM, vocab_size=len(tokenizer))
    for name, data in (("llm_config.json", llm), ("vit_config.json", VIT), ("config.json", TOP)):
        (path / name).write_text(json.dumps(data, indent=1))
    gen = torch.Generator().manual_seed(seed)
    vae = AutoencoderKL(kl_config(VAE))
    n = len(VAE.ch_mult)
    ae = {diffusers_to_bfl(k, n): (v[:, :, None, None] if ".attentions.0.to_" in k
                                   and k.endswith("weight") else v)
          for k, v in _randomize(vae, gen).items()}
    save_file(ae, str(path / "ae.safetensors"))
    assert vae_config(path / "ae.safetensors") == VAE
    model = Bagel(BagelConfig.from_folder(path))
    save_file(_randomize(model, gen), str(path / "ema.safetensors"))
    return path
