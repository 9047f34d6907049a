"""Text-to-image inside HunyuanImage-3.0's transformer (the upstream
HunyuanImage3Text2ImagePipeline's loop), CFG rows [conditional, unconditional]:

    1. prefix: the tokens before <timestep> run once (causal); their keys/values are kept
    2. per step t = 1000 sigma:  tokens [<timestep> = timestep_emb(t), patch_embed(x, time_embed(t))]
       at their 2D rope positions; <timestep> sees the prefix and itself, the image tokens see
       the prefix, <timestep> and every image token; v = final_layer(last hidden, time_embed_2(t))
    3. v = v_u + g (v_c - v_u); Euler: x += v (sigma_next - sigma), sigmas = shift(linspace(1, 0))
    4. the VAE decodes x
The token layout (prompt template, image slice, timestep index) comes in the request; tokens after
the image (<eoi>, the template's suffix) do not reach the image and are not run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from omnistage.models.hunyuan_image3.model import HunyuanImage3
from omnistage.models.hunyuan_image3.transformer import rope_cos_sin


@dataclass(frozen=True)
class GenerationRequest:
    tokens: Tensor            # (2, S) long: the conditional and unconditional rows
    timestep_index: int       # where <timestep> is (the image follows it)
    image_start: int          # first image token
    token_h: int
    token_w: int
    noise: Tensor             # (1, C, token_h, token_w): the initial latents
    steps: int
    guidance_scale: float
    flow_shift: float


def sigmas(steps: int, shift: float) -> Tensor:
    s = torch.linspace(1, 0, steps + 1)
    return s if shift == 1.0 else shift * s / (1 + (shift - 1) * s)


def image_positions(start: int, h: int, w: int) -> Tensor:
    """(h*w, 2) integer (y, x) rope positions of an image whose tokens start at `start`:
    centred on the span the tokens take, y0 = start + (w h - h) / 2, truncated as upstream."""
    y0, x0 = start + (w * h - h) / 2, start + (w * h - w) / 2
    ys = (y0 + torch.arange(h, dtype=torch.float32)).long()
    xs = (x0 + torch.arange(w, dtype=torch.float32)).long()
    return torch.stack(torch.meshgrid(ys, xs, indexing="ij"), -1).reshape(-1, 2)


def prefix_kv(model: HunyuanImage3, toks: Tensor) -> list[tuple[Tensor, Tensor]]:
    """The tokens before <timestep> (B, P), causal -> each layer's keys and values."""
    b, p = toks.shape
    pos = torch.arange(p, device=toks.device)[None, :, None].expand(b, p, 2)
    cos, sin = rope_cos_sin(pos, model.cfg.head_dim, model.cfg.rope_theta)
    mask = torch.ones(p, p, dtype=torch.bool, device=toks.device).tril()[None, None]
    _, kv = model.model(model.model.wte(toks), cos, sin, mask)
    return kv


def step_geometry(model: HunyuanImage3, timestep_index: int, image_start: int, h: int, w: int,
                  device) -> tuple[Tensor, Tensor, Tensor]:
    """Rope and mask of a step's tokens [<timestep>, image (h*w)] after the P-token prefix."""
    n, p = h * w, timestep_index
    pos = torch.cat([torch.tensor([[p, p]]), image_positions(image_start, h, w)])
    cos, sin = rope_cos_sin(pos[None].to(device), model.cfg.head_dim, model.cfg.rope_theta)
    mask = torch.ones(1 + n, p + 1 + n, dtype=torch.bool, device=device)
    mask[0, p + 1:] = False                                    # <timestep> is causal
    return cos, sin, mask[None, None]


def velocity(model: HunyuanImage3, x: Tensor, t: Tensor, kv, geometry) -> Tensor:
    """x (B, C, h, w) latents, t (B,) -> the predicted velocity (B, C, h, w)."""
    cos, sin, mask = geometry
    h, w = x.shape[-2:]
    ts_tok = model.timestep_emb(t)[:, None]                              # (B, 1, H)
    img = model.patch_embed(x, model.time_embed(t))                      # (B, h*w, H)
    hidden, _ = model.model(torch.cat([ts_tok, img], 1), cos, sin, mask, kv)
    return model.final_layer(hidden[:, 1:], model.time_embed_2(t), h, w)


@torch.no_grad()
def generate_image(model: HunyuanImage3, req: GenerationRequest) -> tuple[Tensor, Tensor]:
    """-> (final latents (1, C, h, w), image (1, 3, H, W) in [-1, 1])."""
    if req.image_start != req.timestep_index + 1:
        raise ValueError("the image tokens must follow the <timestep> token")
    device = req.tokens.device
    kv = prefix_kv(model, req.tokens[:, :req.timestep_index])
    geometry = step_geometry(model, req.timestep_index, req.image_start, req.token_h,
                             req.token_w, device)
    sig = sigmas(req.steps, req.flow_shift)
    x = req.noise.float()
    for i in range(req.steps):
        t = (sig[i] * 1000).to(torch.float32).expand(2).to(device)
        v = velocity(model, torch.cat([x, x]).to(model.cfg_dtype()), t, kv, geometry).float()
        v_c, v_u = v.chunk(2)
        x = x + (v_u + req.guidance_scale * (v_c - v_u)) * (sig[i + 1] - sig[i])
    image = model.vae.decode(x.to(model.cfg_dtype()))
    return x, image.float()
