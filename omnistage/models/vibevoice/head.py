"""VibeVoice's diffusion head and connectors.

The head predicts v for one acoustic latent per speech position, conditioned on the LM's hidden
state there and on the diffusion timestep (adaLN-modulated SwiGLU blocks):

    x (B, latent) -> noisy_images_proj -> h (B, H)
    c = cond_proj(condition) + timestep_proj(sinusoid(t))                        (B, H)
    per layer: shift, scale, gate = linear(silu(c)); h += gate * ffn(norm(h) * (1 + scale) + shift)
    final: shift, scale = linear_1(silu(c)); out = linear_2(rms(h) * (1 + scale) + shift)

The connectors (acoustic `multi_modal_projector`, `semantic_connector`) map a latent frame back
to the LM's width: linear_1 -> RMSNorm -> linear_2. Parameter names follow the checkpoint's
`model.diffusion_head.*` / `model.multi_modal_projector.*` / `model.semantic_connector.*`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.norm import RMSNorm


@dataclass(frozen=True, slots=True)
class DiffusionHeadConfig:
    hidden_size: int
    latent_size: int
    num_hidden_layers: int
    intermediate_size: int
    rms_norm_eps: float
    frequency_embedding_size: int
    diffusion_max_period: int


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TimestepMLP(nn.Module):
    def __init__(self, freq_size: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(freq_size, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.silu(self.fc1(x)))


class AdaLNBlock(nn.Module):
    def __init__(self, cfg: DiffusionHeadConfig) -> None:
        super().__init__()
        self.ffn = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.linear = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)

    def forward(self, h: Tensor, c: Tensor) -> Tensor:
        shift, scale, gate = self.linear(F.silu(c)).chunk(3, dim=-1)
        return h + gate * self.ffn(self.norm(h) * (1 + scale) + shift)


class FinalLayer(nn.Module):
    def __init__(self, cfg: DiffusionHeadConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.linear_1 = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size, bias=False)
        self.linear_2 = nn.Linear(cfg.hidden_size, cfg.latent_size, bias=False)

    def forward(self, h: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.linear_1(F.silu(c)).chunk(2, dim=-1)
        normed = F.rms_norm(h, (h.shape[-1],), eps=self.eps)   # no weight
        return self.linear_2(normed * (1 + scale) + shift)


class VibeVoiceDiffusionHead(nn.Module):
    def __init__(self, cfg: DiffusionHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.noisy_images_proj = nn.Linear(cfg.latent_size, cfg.hidden_size, bias=False)
        self.cond_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.timestep_proj = TimestepMLP(cfg.frequency_embedding_size, cfg.hidden_size)
        self.layers = nn.ModuleList(AdaLNBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layer = FinalLayer(cfg)
        half = cfg.frequency_embedding_size // 2
        freq = torch.exp(-math.log(cfg.diffusion_max_period)
                         * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freq", freq, persistent=False)

    def forward(self, noisy: Tensor, timesteps: Tensor, condition: Tensor) -> Tensor:
        """noisy (B, latent), timesteps (B,) (float, the training timestep), condition (B, H)
        -> the predicted v (B, latent)."""
        args = timesteps[:, None].float() * self.freq[None].to(timesteps.device)
        t_emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(timesteps.dtype)
        c = self.cond_proj(condition) + self.timestep_proj(t_emb)
        h = self.noisy_images_proj(noisy)
        for layer in self.layers:
            h = layer(h, c)
        return self.final_layer(h, c)


class SpeechConnector(nn.Module):
    """A latent frame (..., in) -> the LM's width (..., H)."""

    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden)
        self.act = RMSNorm(hidden, eps=1e-6)   # the checkpoint names the norm "act"
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))
