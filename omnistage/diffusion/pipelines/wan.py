"""Wan text-to-video (Wan2.1 T2V, one transformer): diffusers' `WanPipeline.__call__` split
into the engine's phases (omnistage/diffusion/pipeline.py), numerics kept step for step.

    encode:   UMT5 over each prompt padded to 512 tokens, the rows past the prompt zeroed
              (models/text_encoders/umt5.py encode_wan_prompts); the negative prompt the same
              way when guidance_scale > 1 (an unset one encodes as "")
    prepare:  randn (n, z, 1 + (F-1)/4, H/8, W/8) float32 on the request's CPU generator;
              the schedule of flow UniPC (solvers/unipc_flow.py: sigmas and the whole-number
              timesteps the transformer is fed, kept in the request's cond)
    velocity: one transformer call over every row's prompt, then the guided rows again with
              their negative prompt; comb = uncond + g * (cond - uncond)
    decode:   denormalize -> the causal video VAE -> (x/2 + 0.5).clamp(0, 1) -> uint8
              (n, F, H, W, 3), a stage's tensors["video"]

Each request steps with its own UniPC state (the engine holds it, `solver`). Step caching
(the request's cache_threshold) keeps a state per request and branch (cond, uncond); the
transformer's forward replays from CUDA graphs when the stage turns them on, except on steps
that cache. Not yet: the image-to-video variants (CLIP image tokens, Wan2.2 TI2V's
first-frame latents), Wan2.2 A14B's two experts.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.diffusion.params import DiffusionParams, check_size
from omnistage.diffusion.pipeline import (GraphedTransformer, check_conditioning,
                                          encode_with_negatives)
from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion.solvers.unipc_flow import FlowUniPC, UniPCConfig
from omnistage.layers.step_cache import cache_groups
from omnistage.models.autoencoder_kl_wan import AutoencoderKLWan
from omnistage.models.text_encoders import UMT5Encoder, encode_wan_prompts
from omnistage.models.wan_transformer import WanTransformer3DModel
from omnistage.registry import VideoSpec

DEFAULT_GUIDANCE = 5.0          # diffusers' WanPipeline default
MAX_SIZE = 1280
SPEC = VideoSpec(default_size=(832, 480), size_multiple=16, default_num_frames=81,
                 max_num_frames=81, frame_multiple=4, frame_offset=1, fps=16)


def video_spec(path: str | Path) -> VideoSpec:
    """What /v1/videos may ask of a Wan2.1 T2V folder."""
    return SPEC


def guided(params: DiffusionParams) -> bool:
    return params.guidance(DEFAULT_GUIDANCE) > 1.0


class WanPromptEncoder:
    """UMT5 and its tokenizer: the text part of `WanPipeline.__call__`, batched."""

    def __init__(self, encoder: UMT5Encoder, tokenizer, device: torch.device) -> None:
        self.encoder = encoder.to(device).eval()
        self.tokenizer = tokenizer
        self.device = device

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device,
                        dtype: torch.dtype | None) -> WanPromptEncoder:
        path = Path(path)
        encoder = UMT5Encoder.from_pretrained(path / "text_encoder", device, dtype)
        return cls(encoder, AutoTokenizer.from_pretrained(path / "tokenizer"), device)

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        if not prompt.strip():
            raise ValueError("prompt: must be non-empty")

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """Per request: prompt_embeds (512, D), and negative_prompt_embeds when guided."""
        def encode_texts(texts: list[str]) -> list[Tensor]:
            return list(encode_wan_prompts(self.encoder, self.tokenizer, texts).unbind(0))

        return encode_with_negatives(encode_texts, prompts, params, guided)


class WanPipeline(GraphedTransformer):
    label = "Wan"
    graphable = True
    parallel_axes: tuple[str, ...] = ()
    heads_key = "num_attention_heads"
    video = SPEC

    def __init__(self, transformer: WanTransformer3DModel, vae: AutoencoderKLWan,
                 prompt_encoder: WanPromptEncoder, solver: FlowUniPC,
                 device: torch.device) -> None:
        self.transformer = transformer.to(device).eval()
        self.vae = vae.to(device).eval()
        self.prompt_encoder = prompt_encoder
        self.solver = solver                     # the engine steps every request with it
        self.device = device
        self.dtype = next(transformer.parameters()).dtype

    @classmethod
    def from_pretrained(cls, path: str | Path, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True) -> WanPipeline:
        """A diffusers Wan folder: transformer/, vae/ (float32, as diffusers runs it),
        text_encoder/ + tokenizer/ and scheduler/ (flow UniPC)."""
        path = Path(path)
        transformer = WanTransformer3DModel.from_pretrained(path / "transformer", device, dtype)
        vae = AutoencoderKLWan.from_pretrained(path / "vae", device, torch.float32)
        encoder = WanPromptEncoder.from_pretrained(path, device, dtype)
        solver = FlowUniPC(UniPCConfig.from_json(path / "scheduler" / "scheduler_config.json"))
        return cls(transformer, vae, encoder, solver, device)

    def _shape(self, params: DiffusionParams) -> tuple[int, int, int]:
        """(frames, height, width) asked, or the defaults."""
        width, height = self.video.default_size
        return (params.num_frames or self.video.default_num_frames, params.height or height,
                params.width or width)

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        if prompt is not None:
            self.prompt_encoder.validate(prompt, params)
        if image is not None or params.image is not None:
            raise ValueError("image: this Wan checkpoint makes video from text only")
        frames, height, width = self._shape(params)
        t = self.vae.cfg.temporal_downscale
        if (frames - 1) % t:
            raise ValueError(f"num_frames={frames}: must be 1 + a multiple of {t} (the VAE's "
                             "temporal factor)")
        check_size(height, width, self.vae.cfg.downscale * 2, MAX_SIZE,
                   f"VAE factor {self.vae.cfg.downscale} x 2x2 patches")

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Encode the prompt(s); the latents (float32 noise) and UniPC's schedule."""
        (cond,) = self.prompt_encoder.encode([prompt], [params])
        frames, height, width = self._shape(params)
        cfg = self.vae.cfg
        shape = (params.num_images, self.transformer.cfg.in_channels,
                 1 + (frames - 1) // cfg.temporal_downscale, height // cfg.downscale,
                 width // cfg.downscale)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        sigmas, timesteps = self.solver.make_sigmas(params.num_inference_steps)
        expected = {k: (2, self.transformer.cfg.text_dim) for k in cond}
        cond = check_conditioning(cond, expected, self.device, self.dtype)
        return latents, sigmas, {**cond, "timesteps": timesteps}

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """Every row with its prompt, then the guided rows with their negative prompt, in one
        transformer call at each request's whole-number timestep."""
        counts = [r.latents.shape[0] for r in requests]
        texts, neg_texts, steps, neg_steps, spans = [], [], [], [], []
        start = 0
        for r, n in zip(requests, counts):
            t = r.cond["timesteps"][r.step_idx].expand(n)
            texts += [r.cond["prompt_embeds"]] * n
            steps.append(t)
            if "negative_prompt_embeds" in r.cond:
                neg_texts += [r.cond["negative_prompt_embeds"]] * n
                neg_steps.append(t)
                spans.append((start, n, r.params.guidance(DEFAULT_GUIDANCE)))
            start += n
        idx = torch.cat([torch.arange(s, s + n) for s, n, _ in spans] or [torch.arange(0)])
        x = torch.cat([latents, latents[idx.to(latents.device)]]).to(self.dtype)
        t = torch.cat(steps + neg_steps).to(self.device)
        step_cache = None
        if any(r.params.cache_threshold is not None for r in requests):
            guided_rows = ["negative_prompt_embeds" in r.cond for r in requests]
            step_cache = cache_groups(requests, counts, [("cond", [True] * len(requests)),
                                                         ("uncond", guided_rows)])
        out = self.run_transformer(x, t, torch.stack(texts + neg_texts), step_cache=step_cache)
        pred, neg = out[:latents.shape[0]], out[latents.shape[0]:]
        k = 0
        for s, n, scale in spans:
            uncond = neg[k:k + n]
            pred[s:s + n] = uncond + scale * (pred[s:s + n] - uncond)
            k += n
        return pred

    def run_transformer(self, x: Tensor, t: Tensor, text: Tensor, **kwargs: object) -> Tensor:
        """GraphedTransformer's, except with a timestep per token (TI2V's first frame at 0):
        finding their distinct values syncs the host, which a CUDA graph cannot hold."""
        if t.dim() > 1:
            return self.transformer(x, t, text, **kwargs)
        return super().run_transformer(x, t, text, **kwargs)

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """-> uint8 (n, F, H, W, 3)."""
        z = self.vae.denormalize(latents.to(self.device, torch.float32))
        video = (self.vae.decode(z) / 2 + 0.5).clamp(0, 1)                # (n, 3, F, H, W)
        return (video * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()
