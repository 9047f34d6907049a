"""HunyuanImage3: the checkpoint's text-to-image parts on our layers, loaded from the Hugging Face
folder as-is (config.json, model.safetensors[.index.json]). The understanding ViT
(`vision_model.*`, `vision_aligner.*`) and the VAE encoder are not built: the text-to-image
path does not read them. The LM head is (text.py: the greedy text the model writes)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.layers.linear import copy_checked
from omnistage.models.hunyuan_image3.config import HunyuanImage3Config
from omnistage.models.hunyuan_image3.image_heads import FinalLayer, PatchEmbed, TimestepEmbedder
from omnistage.models.hunyuan_image3.transformer import Backbone
from omnistage.models.hunyuan_image3.vae import HunyuanImage3Vae
from omnistage.models.loader import _default_dtype, iter_safetensors

SKIPPED = ("vision_model.", "vision_aligner.", "vae.encoder.")
_EXPERT = re.compile(r"(?P<base>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_and_up_proj|down_proj)"
                     r"\.weight")
_SHARED = re.compile(r".+\.mlp\.shared_mlp\.gate_and_up_proj\.weight")


class HunyuanImage3(nn.Module):
    def __init__(self, cfg: HunyuanImage3Config) -> None:
        super().__init__()
        if cfg.patch_size != 1:
            raise NotImplementedError(f"patch_size {cfg.patch_size}: only 1 is supported")
        self.cfg = cfg
        lat, hid, size = cfg.vae.latent_channels, cfg.patch_embed_hidden_dim, cfg.hidden_size
        self.model = Backbone(cfg)
        self.timestep_emb = TimestepEmbedder(size)      # the <timestep> token
        self.time_embed = TimestepEmbedder(size)        # conditions patch_embed
        self.patch_embed = PatchEmbed(lat, hid, size)
        self.time_embed_2 = TimestepEmbedder(size)      # conditions final_layer
        self.final_layer = FinalLayer(size, hid, lat)
        self.vae = HunyuanImage3Vae(cfg.vae)
        self.lm_head = nn.Linear(size, cfg.vocab_size, bias=False)

    def cfg_dtype(self) -> torch.dtype:
        return self.model.wte.weight.dtype

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> HunyuanImage3:
        path = Path(path)
        with _default_dtype(dtype), torch.device(device):
            model = cls(HunyuanImage3Config.from_folder(path))
        model.load_weights(iter_safetensors(path))
        return model.eval().requires_grad_(False)

    def load_weights(self, weights) -> None:
        """Checkpoint tensors by their names; every parameter of ours must be filled."""
        params = dict(self.named_parameters())
        missing = set(params)
        for name, tensor in weights:
            if name.startswith(SKIPPED):
                continue
            filled = self._load_one(params, name, tensor)
            if filled is None:
                raise ValueError(f"checkpoint tensor {name!r} has no parameter here")
            missing.discard(filled)
        if missing:
            raise ValueError(f"parameters not in the checkpoint: {sorted(missing)[:8]}")

    @staticmethod
    def _load_one(params: dict[str, nn.Parameter], name: str, t: Tensor) -> str | None:
        m = _EXPERT.fullmatch(name)
        if m is not None:                          # gate_and_up rows are | up | gate |
            pname = f"{m['base']}.{'down_proj' if m['proj'] == 'down_proj' else 'gate_up_proj'}"
            p, e = params[pname], int(m["e"])
            if m["proj"] == "down_proj":
                p.weight_loader(p, t, (e, None))
            else:
                up, gate = t.chunk(2, dim=0)
                p.weight_loader(p, gate, (e, 0))
                p.weight_loader(p, up, (e, 1))
            return pname
        p = params.get(name)
        if p is None:
            return None
        if _SHARED.fullmatch(name):
            up, gate = t.chunk(2, dim=0)
            p.weight_loader(p, gate, 0)
            p.weight_loader(p, up, 1)
        elif hasattr(p, "weight_loader"):
            p.weight_loader(p, t)
        else:
            copy_checked(p.data, t.to(p.dtype))
        return name
