"""HunyuanVideo-1.5 text-to-video: diffusers' `HunyuanVideo15Pipeline.__call__` split into the
engine's phases (omnistage/diffusion/pipeline.py), numerics kept step for step.

    encode:   Qwen2.5-VL hidden states of the templated prompt (the system prompt cropped off)
              and byT5 states of its quoted glyph texts, each with its mask
              (models/text_encoders/hunyuan_video15.py); the negative prompt the same way
              when the guider guides (an unset one encodes as ""). Kept per request as the
              valid tokens only (the transformer drops padded ones anyway).
    prepare:  randn (n, z, 1 + (F-1)/4, H/16, W/16) float32 on the request's CPU generator;
              flow-match Euler's schedule from sigmas linspace(1, 0, N+1)[:-1], shifted by
              the scheduler's `shift` (or the request's flow_shift); the condition channels
              [z zeros | mask 0] of text-to-video
    velocity: every row with its prompt, then the rows whose request guides at this step with
              its negative prompt, in one transformer call at the request's timestep:
              diffusers' ClassifierFreeGuidance (guider/guider_config.json): guided while
              start * N <= step < stop * N and the scale is not 1;
              pred = uncond + g * (cond - uncond) (use_original_formulation: cond + ...),
              then rescaled toward cond's std by guidance_rescale
    decode:   latents / scaling_factor -> the video VAE -> (x/2 + 0.5).clamp(0, 1) -> uint8
              (n, F, H, W, 3)

Each request steps with flow-match Euler on its own schedule (the engine holds the step), so
one batch holds requests at different steps. Step caching (the request's cache_threshold)
keeps a state per request and branch. Image-to-video is hunyuan_video15_i2v.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.cfg import GuidedRows, run_branches
from omnistage.diffusion.pipeline import DiffusionPipeline
from omnistage.diffusion.pipelines.hunyuan_video15_sr import (HunyuanVideo15Options,
                                                               SuperResolution)
from omnistage.diffusion.pipelines.hunyuan_video15_text import PromptEncoder
from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion.solvers.flow_match_euler import FlowMatchEulerConfig, make_sigmas
from omnistage.diffusion_params import DiffusionParams, check_size
from omnistage.errors import InputError
from omnistage.layers.groups import stage_ranks
from omnistage.layers.step_cache import cache_groups
from omnistage.models.autoencoder_kl_hunyuan_video15 import AutoencoderKLHunyuanVideo15
from omnistage.models.diffusers_loader import read_config
from omnistage.models.hunyuan_video15_transformer import (HunyuanVideo15Transformer3DModel,
                                                          HunyuanVideo15TransformerConfig)
from omnistage.registry import VideoSpec

MAX_SIZE = 1920
DEFAULT_ASPECT = (9, 16)          # (height, width): diffusers' default_aspect_ratio 16:9
TEXT_KEYS = ("prompt_embeds", "prompt_embeds_2")
NEGATIVE_KEYS = ("negative_prompt_embeds", "negative_prompt_embeds_2")


def bucket_size(height: float, width: float, target_size: int, multiple: int) -> tuple[int, int]:
    """(height, width): the resolution bucket of about target_size^2 pixels (sides multiples
    of `multiple`, aspect at most 4:1) nearest the aspect height / width, on the side of the
    aspect that keeps the longer side long (the upstream `get_closest_ratio` rule that
    diffusers' `calculate_default_height_width` keeps)."""
    cells = round((target_size / multiple) ** 2)
    buckets, w, h = [], cells, 1
    while w > 0:
        if max(w, h) / min(w, h) <= 4.0:
            buckets.append((h * multiple, w * multiple))
        if (h + 1) * w <= cells:
            h += 1
        else:
            w -= 1
    aspect = float(height) / float(width)
    ratios = np.array([round(bh / bw, 5) for bh, bw in buckets]) - aspect
    side = [i for i, d in enumerate(ratios) if (d <= 0 if aspect >= 1 else d >= 0)]
    return buckets[min(side, key=lambda i: abs(ratios[i]))]


@dataclass(frozen=True, slots=True)
class GuiderConfig:
    """diffusers' `ClassifierFreeGuidance` config (guider/guider_config.json)."""
    guidance_scale: float = 7.5
    guidance_rescale: float = 0.0
    use_original_formulation: bool = False
    start: float = 0.0
    stop: float = 1.0
    enabled: bool = True

    @classmethod
    def read(cls, path: Path) -> GuiderConfig:
        file = path / "guider" / "guider_config.json"
        raw = json.loads(file.read_text()) if file.is_file() else {}
        if raw.get("_class_name", "ClassifierFreeGuidance") != "ClassifierFreeGuidance":
            raise ValueError(f"{file}: guider {raw['_class_name']!r} is not supported "
                             "(ClassifierFreeGuidance is)")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})

    def scale(self, params: DiffusionParams) -> float:
        return params.guidance(self.guidance_scale)

    def guides(self, params: DiffusionParams) -> bool:
        """Whether a negative prompt is encoded at all (diffusers' num_conditions > 1)."""
        neutral = 0.0 if self.use_original_formulation else 1.0
        return self.enabled and not np.isclose(self.scale(params), neutral)

    def guides_at(self, params: DiffusionParams, step_idx: int, num_steps: int) -> bool:
        return self.guides(params) and \
            int(self.start * num_steps) <= step_idx < int(self.stop * num_steps)

    def mix(self, cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
        pred = (cond if self.use_original_formulation else uncond) + scale * (cond - uncond)
        if self.guidance_rescale > 0.0:     # diffusers' rescale_noise_cfg, per row
            dims = list(range(1, cond.dim()))
            rescaled = pred * (cond.std(dim=dims, keepdim=True) /
                               pred.std(dim=dims, keepdim=True))
            pred = self.guidance_rescale * rescaled + (1 - self.guidance_rescale) * pred
        return pred


def video_spec(path: str | Path) -> VideoSpec:
    """What /v1/videos may ask of a HunyuanVideo-1.5 t2v folder, read from its configs."""
    path = Path(path)
    vae = read_config(path / "vae")
    cfg = HunyuanVideo15TransformerConfig.from_dict(read_config(path / "transformer"))
    return make_spec(vae["spatial_compression_ratio"] * cfg.patch_size,
                     vae["temporal_compression_ratio"], cfg.target_size)


def make_spec(multiple: int, temporal: int, target_size: int, fps: int = 15,
              image_to_video: bool = False) -> VideoSpec:
    """121 frames (diffusers' default), the 16:9 bucket of the checkpoint's target size;
    fps as diffusers' examples write the files (t2v 15, i2v 24)."""
    height, width = bucket_size(*DEFAULT_ASPECT, target_size, multiple)
    return VideoSpec(default_size=(width, height), size_multiple=multiple,
                     default_num_frames=121, max_num_frames=121, frame_multiple=temporal,
                     frame_offset=1, fps=fps, text_to_video=not image_to_video,
                     image_to_video=image_to_video)


def pad_rows(states: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Per row (L_i, D) -> (R, max L_i (at least 1), D) zero-padded, mask (R, L) float."""
    length = max(1, max(s.shape[0] for s in states))
    out = states[0].new_zeros(len(states), length, states[0].shape[-1])
    mask = states[0].new_zeros(len(states), length)
    for i, s in enumerate(states):
        out[i, :s.shape[0]], mask[i, :s.shape[0]] = s, 1.0
    return out, mask


class HunyuanVideo15Pipeline(DiffusionPipeline):
    label = "HunyuanVideo-1.5"
    # CFG-parallel: the prompt rows on CFG rank 0, the negative prompt's on rank 1; Ulysses,
    # ring and TP inside the transformer (models/hunyuan_video15_transformer.py)
    parallel_axes = ("cfg", "ulysses", "ring", "tp")
    Options = HunyuanVideo15Options
    sr: SuperResolution | None = None       # options.sr: the super-resolution pass

    def __init__(self, transformer: HunyuanVideo15Transformer3DModel,
                 vae: AutoencoderKLHunyuanVideo15, prompt_encoder: PromptEncoder | None,
                 scheduler: FlowMatchEulerConfig, guider: GuiderConfig,
                 device: torch.device) -> None:
        self.transformer = transformer.to(device).eval()
        self.vae = vae.to(device).eval()
        self.prompt_encoder = prompt_encoder
        self.scheduler, self.guider, self.device = scheduler, guider, device
        self.dtype = transformer.x_embedder.proj.weight.dtype
        self.cfg_ranks = stage_ranks().cfg      # CFG-parallel: branch c runs on rank c
        self.options = HunyuanVideo15Options()
        self.video = make_spec(vae.cfg.downscale * transformer.cfg.patch_size,
                               vae.cfg.temporal_downscale, transformer.cfg.target_size)

    @classmethod
    def from_pretrained(cls, path: str | Path, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True
                        ) -> HunyuanVideo15Pipeline:
        """A diffusers HunyuanVideo-1.5 folder: transformer/, vae/ (float32, as diffusers runs
        it here), text_encoder(_2)/ + tokenizer(_2)/, scheduler/ (flow-match Euler), guider/."""
        path = Path(path)
        transformer = HunyuanVideo15Transformer3DModel.from_pretrained(path / "transformer",
                                                                       device, dtype)
        vae = AutoencoderKLHunyuanVideo15.from_pretrained(path / "vae", device, torch.float32)
        guider = GuiderConfig.read(path)
        encoder = (PromptEncoder.from_pretrained(path, device, dtype, guider.guides)
                   if text_encoders else None)
        scheduler = FlowMatchEulerConfig.from_json(path / "scheduler" / "scheduler_config.json")
        return cls(transformer, vae, encoder, scheduler, guider, device)

    def _shape(self, params: DiffusionParams) -> tuple[int, int, int]:
        width, height = self.video.default_size
        return (params.num_frames or self.video.default_num_frames, params.height or height,
                params.width or width)

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        if prompt is not None and not prompt.strip():
            raise InputError("prompt: must be non-empty", "prompt")
        if (image is not None or params.image is not None) and not self.video.image_to_video:
            raise InputError("image: this HunyuanVideo-1.5 checkpoint makes video from text "
                             "only (image-to-video is its i2v checkpoint)", "image")
        frames, height, width = self._shape(params)
        t = self.vae.cfg.temporal_downscale
        if (frames - 1) % t:
            raise InputError(f"num_frames={frames}: must be 1 + a multiple of {t} (the VAE's "
                             "temporal factor)", "num_frames")
        check_size(height, width, self.video.size_multiple, MAX_SIZE,
                   f"VAE factor {self.vae.cfg.downscale} x {self.transformer.cfg.patch_size} "
                   "patches")

    def unused_params(self, params: DiffusionParams) -> dict[str, str]:
        if params.boundary_ratio is not None:
            return {"boundary_ratio": "HunyuanVideo-1.5 has one transformer"}
        return {}

    def schedule(self, params: DiffusionParams) -> tuple[Tensor, Tensor]:
        """(sigmas (N+1,), timesteps (N,)): diffusers' custom linspace sigmas, shifted."""
        cfg = self.scheduler if params.flow_shift is None else \
            replace(self.scheduler, shift=params.flow_shift)
        n = params.num_inference_steps
        return make_sigmas(cfg, n, sigmas=np.linspace(1.0, 0.0, n + 1)[:-1])

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        (cond,) = self.prompt_encoder.encode([prompt], [params])
        return self.prepare_latents(params, generator, image, cond)

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None, text: dict[str, Tensor] | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        frames, height, width = self._shape(params)
        shape = (params.num_images, self.transformer.cfg.out_channels,
                 1 + (frames - 1) // self.vae.cfg.temporal_downscale,
                 height // self.vae.cfg.downscale, width // self.vae.cfg.downscale)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        sigmas, timesteps = self.schedule(params)
        cond = {k: v.to(self.device, self.dtype) for k, v in (text or {}).items()}
        cond["timesteps"] = timesteps
        cond["condition"] = self.condition(params, latents, image)
        return latents, sigmas, cond

    def condition(self, params: DiffusionParams, latents: Tensor, image: Image.Image | None
                  ) -> Tensor:
        """The condition channels [first-frame latents z | mask 1] (1, z + 1, F', h, w):
        zeros for text-to-video."""
        return latents.new_zeros(1, latents.shape[1] + 1, *latents.shape[2:]).to(self.dtype)

    def extra_inputs(self, rows: list[DiffusionRequest]) -> dict[str, Tensor]:
        """The transformer's further inputs for these rows (image-to-video's image tokens)."""
        return {}

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """Every row with its prompt, then the rows guided at this step with their negative
        prompt, in one transformer call; mixed as the guider does."""
        counts = [r.latents.shape[0] for r in requests]
        guided = GuidedRows.of(
            requests, lambda r: "negative_prompt_embeds" in r.cond and self.guider.guides_at(
                r.params, r.step_idx, r.num_steps), lambda r: self.guider.scale(r.params))
        rows, neg_rows = [], []
        for r, n, g in zip(requests, counts, guided.guided):
            rows += [r] * n
            neg_rows += [r] * n if g else []
        inputs = self.model_inputs(torch.cat([latents, latents[guided.idx.to(latents.device)]]),
                                   rows, neg_rows)
        branches = guided.branches()
        cached = any(r.params.cache_threshold is not None for r in requests)
        num_rows = latents.shape[0]
        parts = [slice(0, num_rows), slice(num_rows, num_rows + len(neg_rows))]

        def run(chosen: list[int]) -> Tensor:           # rows of a branch are contiguous
            part = slice(parts[chosen[0]].start, parts[chosen[-1]].stop)
            step_cache = (cache_groups(requests, counts, [branches[b] for b in chosen])
                          if cached else None)
            return self.transformer(**{k: v[part] for k, v in inputs.items()},
                                    step_cache=step_cache).float()

        out = run_branches(self.cfg_ranks, [num_rows, len(neg_rows)], run, latents)
        pred, neg = out[:num_rows], out[num_rows:]
        for span, uncond, scale in guided.pairs(pred, neg):
            pred[span] = self.guider.mix(pred[span], uncond, scale)
        return pred

    def model_inputs(self, x: Tensor, rows: list[DiffusionRequest],
                     neg_rows: list[DiffusionRequest]) -> dict[str, Tensor]:
        """The transformer's keyword inputs for latents x (R + U, ...): the prompt rows, then
        the negative prompt rows (`neg_rows`)."""
        everyone = rows + neg_rows
        keys = [TEXT_KEYS] * len(rows) + [NEGATIVE_KEYS] * len(neg_rows)
        text, mask = pad_rows([r.cond[k[0]] for r, k in zip(everyone, keys)])
        glyph, glyph_mask = pad_rows([r.cond[k[1]] for r, k in zip(everyone, keys)])
        condition = torch.cat([r.cond["condition"] for r in everyone]).to(x.device)
        t = torch.stack([r.cond["timesteps"][r.step_idx] for r in everyone]).to(self.device)
        return {"hidden_states": torch.cat([x.to(self.dtype), condition], dim=1),
                "timestep": t.to(self.dtype), "encoder_hidden_states": text,
                "encoder_attention_mask": mask, "encoder_hidden_states_2": glyph,
                "encoder_attention_mask_2": glyph_mask, **self.extra_inputs(everyone)}

    def denoisers(self) -> list[torch.nn.Module]:
        return [self.transformer]

    def configure(self, options: HunyuanVideo15Options) -> None:
        """`sr`: load the super-resolution checkpoints (hunyuan_video15_sr.py) now."""
        if options.sr:
            if stage_ranks().world_size > 1:
                raise ValueError("diffusion.options.sr: the super-resolution pass runs on one "
                                 "rank (no CFG, sequence or tensor parallel stage)")
            self.sr = SuperResolution.from_pretrained(
                options.sr_checkpoint, self.transformer.cfg.target_size, self.device, self.dtype)
        self.options = options

    def final_latents(self, request: DiffusionRequest) -> Tensor:
        """The base loop's latents, or with `sr` the super-resolution pass's from them."""
        if self.sr is None:
            return request.latents
        shape = self.sr.target_shape(tuple(request.latents.shape), self.vae.cfg.downscale,
                                     self.video.size_multiple)
        extra, image_cond = self.sr_inputs(request, shape)
        rows = request.latents.shape[0]
        text, mask = pad_rows([request.cond["prompt_embeds"]] * rows)
        glyph, glyph_mask = pad_rows([request.cond["prompt_embeds_2"]] * rows)
        inputs = {"encoder_hidden_states": text, "encoder_attention_mask": mask,
                  "encoder_hidden_states_2": glyph, "encoder_attention_mask_2": glyph_mask}
        inputs = {k: v.to(self.device, self.sr.dtype) for k, v in (inputs | extra).items()}
        return self.sr.refine(request.latents, inputs, request.generator, shape,
                              self.options.sr_num_inference_steps, image_cond)

    def sr_inputs(self, request: DiffusionRequest, shape: tuple[int, ...]
                  ) -> tuple[dict[str, Tensor], Tensor | None]:
        """The SR transformer's further inputs and condition channels at the high-resolution
        latent `shape`: none for text-to-video (image-to-video: its first frame)."""
        return {}, None

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """-> uint8 (n, F, H, W, 3)."""
        video = self.decode_float(latents, params)                        # (n, 3, F, H, W)
        return (video * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()

    def decode_float(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        z = self.vae.denormalize(latents.to(self.device, torch.float32))
        return (self.vae.decode(z) / 2 + 0.5).clamp(0, 1)
