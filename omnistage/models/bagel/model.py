"""BAGEL (ByteDance-Seed/BAGEL-7B-MoT): one mixture-of-transformers LLM that reads text and ViT
tokens with its understanding expert and denoises VAE latent tokens with its generation expert,
over one sequence and one KV cache. This module holds the weights (ema.safetensors loaded by
name; ae.safetensors through vae.py) and the four ways rows enter the LLM:

    text        [bos] ids [eos]                    und rows, causal,  positions r, r+1, ...
    ViT image   [soi] ViT tokens [eoi]             und rows, full,    every row at position r
    VAE image   [soi] clean latent tokens [eoi]    gen rows, full,    every row at position r
    flow step   [soi] noisy latent tokens [eoi]    gen rows, full,    not stored in the cache

Latent tokens are VAE latents cut in p x p patches (p = latent_patch_size), embedded as
vae2llm(x) + time_embedder(t) + latent_pos_embed(row * max_latent_size + col); the velocity is
llm2vae of the final hidden state. generate.py runs the requests (contexts, greedy text, the
flow loop with its guidance branches).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from omnistage.models.bagel.config import BagelConfig
from omnistage.models.bagel.llm import BagelLanguageModel, KVContext, Rows
from omnistage.models.bagel.vae import load_vae
from omnistage.models.bagel.vit import (MLPconnector, PositionEmbedding, SiglipVisionModel,
                                        grid_position_ids, patchify)


class TimestepEmbedder(nn.Module):
    """Sinusoidal features of t in [0, 1] (cos half first, max period 1e4) -> MLP."""

    def __init__(self, hidden_size: int, num_freqs: int = 256) -> None:
        super().__init__()
        self.num_freqs = num_freqs
        self.mlp = nn.Sequential(nn.Linear(num_freqs, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))

    def forward(self, t: Tensor) -> Tensor:                        # t: (N,) -> (N, hidden)
        half = self.num_freqs // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32,
                                                            device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))


class Bagel(nn.Module):
    def __init__(self, cfg: BagelConfig) -> None:
        super().__init__()
        if cfg.connector_act != "gelu_pytorch_tanh":
            raise NotImplementedError(f"connector_act {cfg.connector_act!r}")
        self.cfg = cfg
        hidden = cfg.llm.hidden_size
        self.language_model = BagelLanguageModel(cfg.llm)
        self.time_embedder = TimestepEmbedder(hidden)
        self.vae2llm = nn.Linear(cfg.patch_latent_dim, hidden)
        self.llm2vae = nn.Linear(hidden, cfg.patch_latent_dim)
        self.latent_pos_embed = PositionEmbedding(cfg.max_latent_size, hidden)
        self.vit_model = SiglipVisionModel(cfg.vit)
        self.connector = MLPconnector(cfg.vit.hidden_size, hidden)
        self.vit_pos_embed = PositionEmbedding(cfg.vit_max_num_patch_per_side, hidden)

    # ---- rows into the LLM --------------------------------------------------------------

    def new_context(self) -> KVContext:
        return KVContext.empty(self.cfg.llm.num_hidden_layers)

    def _run(self, x: Tensor, positions: Tensor, rows: Rows, ctx: KVContext, causal: bool,
             store: bool) -> Tensor:
        return self.language_model.model(x, positions, rows, ctx, causal, store)

    def _embed(self, ids: list[int]) -> Tensor:
        dev = self.vae2llm.weight.device
        return self.language_model.model.embed_tokens(torch.tensor(ids, device=dev))

    def add_tokens(self, ctx: KVContext, ids: list[int], causal: bool = True) -> Tensor:
        """Token ids at positions ctx.rope.. (stored); returns their final hidden states."""
        n = len(ids)
        pos = torch.arange(ctx.rope, ctx.rope + n, device=self.vae2llm.weight.device)
        out = self._run(self._embed(ids), pos, Rows(), ctx, causal, store=True)
        ctx.rope += n
        return out

    def logits(self, hidden: Tensor) -> Tensor:
        return self.language_model.lm_head(hidden)

    def add_vit_image(self, ctx: KVContext, pixels: Tensor, soi: int, eoi: int) -> None:
        """pixels (3, H, W) in [-1, 1], sides divisible by the ViT patch: [soi, ViT, eoi]."""
        p = self.cfg.vit.patch_size
        h, w = pixels.shape[1] // p, pixels.shape[2] // p
        pos_ids = grid_position_ids(h, w, self.cfg.vit_max_num_patch_per_side, pixels.device)
        vit = self.vit_model.vision_model(patchify(pixels, p).to(self.vae2llm.weight.dtype),
                                          pos_ids)
        vit = self.connector(vit) + self.vit_pos_embed(pos_ids)     # (h*w, hidden)
        markers = self._embed([soi, eoi])
        x = torch.cat([markers[:1], vit, markers[1:]])
        self._run(x, self._same_position(ctx, x.shape[0]), Rows(), ctx, causal=False, store=True)
        ctx.rope += 1

    def add_vae_latents(self, ctx: KVContext, latents: Tensor, soi: int, eoi: int) -> None:
        """Clean normalized latents (C, h, w) of a condition image, at t = 0: [soi, lat, eoi]."""
        tokens, hw = self.pack_latents(latents)
        self.step_rows(ctx, tokens, hw, torch.zeros((), device=tokens.device), soi, eoi,
                       store=True)
        ctx.rope += 1

    def step_rows(self, ctx: KVContext, tokens: Tensor, hw: tuple[int, int], t: Tensor,
                  soi: int, eoi: int, store: bool) -> Tensor:
        """Latent tokens (N, p*p*C) at time t through the gen expert after ctx; returns the
        velocity (N, p*p*C) (a flow step) or stores them (a condition image)."""
        n = tokens.shape[0]
        pos_ids = grid_position_ids(*hw, self.cfg.max_latent_size, tokens.device)
        lat = (self.vae2llm(tokens.to(self.vae2llm.weight.dtype))
               + self.time_embedder(t.reshape(1).expand(n)) + self.latent_pos_embed(pos_ids))
        markers = self._embed([soi, eoi])
        x = torch.cat([markers[:1], lat, markers[1:]])
        rows = Rows(und=torch.tensor([0, n + 1], device=x.device),
                    gen=torch.arange(1, n + 1, device=x.device))
        out = self._run(x, self._same_position(ctx, n + 2), rows, ctx, causal=False, store=store)
        return self.llm2vae(out[1:n + 1])

    def _same_position(self, ctx: KVContext, n: int) -> Tensor:
        return torch.full((n,), ctx.rope, dtype=torch.long, device=self.vae2llm.weight.device)

    # ---- latents <-> tokens -------------------------------------------------------------

    def pack_latents(self, latents: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """(C, h*p, w*p) -> tokens (h*w, p*p*C) (each patch (p, p, C)-ordered), (h, w)."""
        p = self.cfg.latent_patch_size
        c, hp, wp = latents.shape
        h, w = hp // p, wp // p
        x = latents[:, :h * p, :w * p].reshape(c, h, p, w, p).permute(1, 3, 2, 4, 0)
        return x.reshape(h * w, p * p * c), (h, w)

    def unpack_latents(self, tokens: Tensor, hw: tuple[int, int]) -> Tensor:
        """tokens (h*w, p*p*C) -> latents (C, h*p, w*p)."""
        p, c = self.cfg.latent_patch_size, self.cfg.vae.z_channels
        h, w = hw
        x = tokens.reshape(h, w, p, p, c).permute(4, 0, 2, 1, 3)
        return x.reshape(c, h * p, w * p)

    # ---- loading ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> tuple[Bagel, nn.Module]:
        """(model, vae) from a BAGEL checkpoint folder. Missing, unexpected or mis-shaped
        tensors of ema.safetensors raise ValueError naming them."""
        path = Path(path)
        cfg = BagelConfig.from_folder(path)
        model = cls(cfg)
        state = load_file(str(path / "ema.safetensors"))
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        bad = [k for k in set(state) & set(expected) if state[k].shape != expected[k].shape]
        if missing or unexpected or bad:
            raise ValueError(f"{path / 'ema.safetensors'}: missing {missing[:8]}, unexpected "
                             f"{unexpected[:8]}, mis-shaped {sorted(bad)[:8]}")
        model.load_state_dict(state, strict=True)
        model = model.to(device=device, dtype=dtype).eval()
        return model, load_vae(path / "ae.safetensors", cfg.vae, device, dtype)
