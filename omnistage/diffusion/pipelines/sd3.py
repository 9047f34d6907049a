"""Stable Diffusion 3 / 3.5 (medium, large) text-to-image: diffusers'
`StableDiffusion3Pipeline.__call__` split into the engine's phases
(omnistage/diffusion/pipeline.py), numerics kept step for step.

    encode:   CLIP-L and CLIP-G (77 tokens each): hidden_states[-2] side by side, zero-padded
              to T5's width, followed by T5-XXL's sequence (max_sequence_length tokens):
              prompt_embeds (1, 77 + S, joint); pooled = [CLIP-L | CLIP-G] projected pooled
              outputs (1, P); the negative prompt ("" unless given) the same way when CFG
              is on (guidance_scale > 1); every text of a batch of requests in one call of each
              encoder (SD3PromptEncoder)
    prepare:  randn (n, C, H/8, W/8) in the model dtype on the request's CPU generator;
              sigmas from the scheduler's own linspace and static shift (3.0), as
              `set_timesteps(N)` makes them
    velocity: one transformer call over the prompt rows of every request and the negative
              rows of those with CFG; timestep = sigma * 1000 as the scheduler's timesteps;
              pred = neg + g * (pos - neg); skip-layer guidance (when the pipeline has it, on
              a request's steps i with N*start < i < N*stop): pred += s * (pos - pos without
              the skipped blocks), one more call over those rows
    decode:   z / scaling + shift -> VAE, each image whole as diffusers' (in tiles only
              above 2048 x 2048 px: AutoencoderKL.decode_images) ->
              (x/2 + 0.5).clamp(0, 1) -> uint8

Every network is ours (two CLIP text encoders with projection, T5, the MMDiT, the VAE);
tokenizers come from transformers. The text encoders may run in a stage of their own (the
pipeline is a split one: see diffusion/pipeline.py). CFG-parallel over two ranks: the prompt
rows on CFG rank 0, the negative and skip-layer rows on rank 1, gathered on both before the
combine. Not ported: image-to-image, a folder without T5 (diffusers then feeds zeros),
clip_skip, step caching, tensor and sequence parallelism.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.diffusion.cfg import GuidedRows, run_branches
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.latent_pipeline import LatentPipelineBase
from omnistage.diffusion.pipeline import PromptEncoder, check_conditioning
from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion.solvers import flow_match_euler as solver
from omnistage.models.autoencoder_kl import AutoencoderKL
from omnistage.models.sd3_transformer import SD3Transformer2DModel
from omnistage.models.text_encoders import CLIPTextEncoder, T5Encoder

DEFAULT_GUIDANCE = 7.0              # diffusers' default; CFG is on above 1
MAX_SEQUENCE_LENGTH = 512           # T5 tokens, diffusers' maximum
DEFAULT_SEQUENCE_LENGTH = 256       # diffusers' default
CLIP_MAX_LENGTH = 77
CLIP_HIDDEN_LAYER = -2              # SD3 reads CLIP's penultimate layer


@dataclass(frozen=True, slots=True)
class SkipLayerGuidance:
    """diffusers' `skip_guidance_layers` and `skip_layer_guidance_scale/start/stop`
    (Stability's advice for 3.5-medium: layers (7, 8, 9), 2.8, 0.01, 0.2). Applies to
    requests with CFG on, at steps i with N*start < i < N*stop."""

    layers: tuple[int, ...]
    scale: float = 2.8
    start: float = 0.01
    stop: float = 0.2

    def __post_init__(self) -> None:
        for name in ("scale", "start", "stop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"skip_layer_guidance.{name}={value!r}: not a number")
        if not self.layers:
            raise ValueError("skip_layer_guidance.layers: empty")
        if not 0.0 <= self.start < self.stop <= 1.0:
            raise ValueError(f"skip_layer_guidance start={self.start}, stop={self.stop}: need "
                             "0 <= start < stop <= 1")

    def is_active(self, step_idx: int, num_steps: int) -> bool:
        return num_steps * self.start < step_idx < num_steps * self.stop


@dataclass(frozen=True, slots=True)
class SD3Options:
    """An SD3 stage's `diffusion.options`."""

    skip_layer_guidance: SkipLayerGuidance | None = None


class Rows(NamedTuple):
    """Rows for one transformer call: latents (n, C, h, w), embeds (n, T, joint), pooled
    (n, P), timestep (n,), and the blocks they skip (skip-layer guidance)."""

    x: Tensor
    embeds: Tensor
    pooled: Tensor
    timestep: Tensor
    skip_layers: tuple[int, ...] = ()


def has_cfg(params: DiffusionParams) -> bool:
    """diffusers' `do_classifier_free_guidance`: guidance_scale > 1 (7.0 by default)."""
    return params.guidance(DEFAULT_GUIDANCE) > 1


def check_text_params(prompt: str | None, params: DiffusionParams) -> None:
    """The request's text, guidance and input fields (prompt None: encoded upstream)."""
    if prompt is not None and not prompt.strip():
        raise ValueError("prompt: must be non-empty")
    if params.true_cfg_scale != 1.0:
        raise ValueError("true_cfg_scale: SD3's guidance_scale is already true CFG (with "
                         "negative_prompt); use guidance_scale")
    if params.negative_prompt is not None and not has_cfg(params):
        raise ValueError(f"negative_prompt: has no effect with guidance_scale="
                         f"{params.guidance(DEFAULT_GUIDANCE)} (CFG needs > 1)")
    if params.image is not None:
        raise ValueError("image: the SD3 pipeline is text-to-image only")
    if params.cache_threshold is not None:
        raise ValueError("cache_threshold: the SD3 pipeline has no step caching")


class SD3PromptEncoder:
    """CLIP-L, CLIP-G and T5: the text part of `StableDiffusion3Pipeline.encode_prompt`,
    batched over requests."""

    def __init__(self, text_encoders: tuple[CLIPTextEncoder, CLIPTextEncoder, T5Encoder],
                 tokenizers: tuple, device: torch.device,
                 max_sequence_length: int = DEFAULT_SEQUENCE_LENGTH) -> None:
        if not 1 <= max_sequence_length <= MAX_SEQUENCE_LENGTH:
            raise ValueError(f"max_sequence_length={max_sequence_length}: must be in "
                             f"[1, {MAX_SEQUENCE_LENGTH}]")
        self.clip_l, self.clip_g, self.t5 = (e.to(device).eval() for e in text_encoders)
        self.tokenizers = tokenizers
        self.device = device
        self.max_sequence_length = max_sequence_length
        # diffusers: the first tokenizer's model_max_length (77) for both CLIPs
        self.clip_max_length = min(tokenizers[0].model_max_length,
                                   self.clip_l.config.max_position_embeddings)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device,
                        dtype: torch.dtype | None) -> SD3PromptEncoder:
        """The folder's text_encoder/, text_encoder_2/ (CLIP with projection), text_encoder_3/
        (T5; in `dtype`, None: their own) and tokenizer/, tokenizer_2/, tokenizer_3/."""
        path = Path(path)
        if not (path / "text_encoder_3").is_dir():
            raise ValueError(f"{path}: no text_encoder_3/ (T5); an SD3 folder without T5 is "
                             "not supported")
        encoders = (CLIPTextEncoder.from_pretrained(path / "text_encoder", device, dtype),
                    CLIPTextEncoder.from_pretrained(path / "text_encoder_2", device, dtype),
                    T5Encoder.from_pretrained(path / "text_encoder_3", device, dtype))
        tokenizers = tuple(AutoTokenizer.from_pretrained(path / name)
                           for name in ("tokenizer", "tokenizer_2", "tokenizer_3"))
        return cls(encoders, tokenizers, device)

    def validate(self, prompt: str, params: DiffusionParams) -> None:
        check_text_params(prompt, params)

    def encode(self, prompts: list[str], params: list[DiffusionParams]
               ) -> list[dict[str, Tensor]]:
        """Per request: prompt_embeds (1, 77 + S, joint) and pooled (1, P), and with CFG
        negative_prompt_embeds and negative_pooled from its negative prompt ("" if unset)."""
        texts = []
        for prompt, p in zip(prompts, params, strict=True):
            texts += [prompt, p.negative_prompt or ""] if has_cfg(p) else [prompt]
        embeds, pooled = self.encode_texts(texts)
        rows = iter(zip(embeds.split(1), pooled.split(1)))
        out = []
        for p in params:
            cond = dict(zip(("prompt_embeds", "pooled"), next(rows)))
            if has_cfg(p):
                cond |= dict(zip(("negative_prompt_embeds", "negative_pooled"), next(rows)))
            out.append(cond)
        return out

    @torch.inference_mode()
    def encode_texts(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """-> prompt embeds (B, 77 + S, joint) and pooled (B, P_l + P_g)."""
        clip_states, pooled = [], []
        for encoder, tokenizer in zip((self.clip_l, self.clip_g), self.tokenizers):
            ids = tokenizer(texts, padding="max_length", max_length=self.clip_max_length,
                            truncation=True, return_tensors="pt").input_ids
            states, pool = encoder(ids.to(self.device), hidden_layer=CLIP_HIDDEN_LAYER)
            clip_states.append(states)                                      # (B, 77, D_i)
            pooled.append(pool)                                             # (B, P_i)
        t5_ids = self.tokenizers[2](texts, padding="max_length",
                                    max_length=self.max_sequence_length, truncation=True,
                                    add_special_tokens=True, return_tensors="pt").input_ids
        t5 = self.t5(t5_ids.to(self.device))                               # (B, S, joint)
        clip = torch.cat(clip_states, dim=-1)                               # (B, 77, D_l + D_g)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))              # (B, 77, joint)
        return torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1)


class StableDiffusion3Pipeline(LatentPipelineBase):
    label = "SD3"
    transformer_cls = SD3Transformer2DModel
    vae_cls = AutoencoderKL
    prompt_encoder_cls = SD3PromptEncoder
    check_text_params = staticmethod(check_text_params)
    packed = False                      # the transformer patches the latents itself
    graphable = True
    parallel_axes = ("cfg",)            # the prompt and the negative prompt's branches
    Options = SD3Options                # a stage's diffusion.options (configure)

    def __init__(self, transformer: SD3Transformer2DModel, vae: AutoencoderKL,
                 prompt_encoder: PromptEncoder | None, scheduler: solver.FlowMatchEulerConfig,
                 device: torch.device) -> None:
        """The size rule is the model's: sides a multiple of VAE factor x patch, at most the
        position table's reach; the default size is diffusers' (sample_size latent pixels).
        Skip-layer guidance starts off (`use_skip_layer_guidance`, or the stage option)."""
        cfg = transformer.cfg
        self.default_size = cfg.sample_size * vae.cfg.downscale
        super().__init__(transformer, vae, prompt_encoder, scheduler, device)
        self.multiple = self.vae_scale_factor * cfg.patch_size
        self.max_size = cfg.pos_embed_max_size * self.multiple
        self.size_rule = f"VAE factor {self.vae_scale_factor} x {cfg.patch_size}x" \
                         f"{cfg.patch_size} patches"
        self.skip_layer_guidance: SkipLayerGuidance | None = None

    def use_skip_layer_guidance(self, slg: SkipLayerGuidance | None) -> None:
        """Skip-layer guidance for every request with CFG from now on (None: off)."""
        num_layers = self.transformer.cfg.num_layers
        bad = [i for i in (slg.layers if slg else ()) if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"skip_layer_guidance.layers {bad}: the transformer has "
                             f"{num_layers} blocks")
        self.skip_layer_guidance = slg

    def configure(self, options: SD3Options) -> None:
        """The stage's `diffusion.options`: `skip_layer_guidance: {layers: [7, 8, 9], scale:
        2.8, start: 0.01, stop: 0.2}` (scale, start, stop optional) turns it on for the
        stage's requests."""
        self.use_skip_layer_guidance(options.skip_layer_guidance)

    # ---- 1. prepare (encode: the base class) ---------------------------------------------

    def check_conditioning(self, tensors: dict[str, Tensor], params: DiffusionParams
                           ) -> dict[str, Tensor]:
        """prompt_embeds (1, T, joint) and pooled (1, P) [and their negatives with CFG]."""
        cfg = self.transformer.cfg
        expected = {"prompt_embeds": (3, cfg.joint_attention_dim),
                    "pooled": (2, cfg.pooled_projection_dim)}
        if has_cfg(params):
            expected |= {f"negative_{k}": v for k, v in expected.items()}
        return check_conditioning(tensors, expected, self.device, self.dtype)

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """-> latents (n, C, h, w), sigmas, {} (no other conditioning)."""
        height, width = self._size(params)
        h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
        cfg, p = self.scheduler, self.transformer.cfg.patch_size
        mu = (solver.calculate_shift((h // p) * (w // p), cfg.base_image_seq_len,
                                     cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)
              if cfg.use_dynamic_shifting else None)
        sigmas = solver.make_sigmas(cfg, params.num_inference_steps, mu=mu)[0]
        latents = torch.randn((params.num_images, self.num_channels_latents, h, w),
                              generator=generator, device=generator.device,
                              dtype=self.dtype).to(self.device)              # (n, C, h, w)
        return latents, sigmas, {}

    # ---- 2. velocity -----------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """latents (R, C, h, w) -> (R, C, h, w). The prompt rows of every request, the
        negative rows of those with CFG and, with skip-layer guidance, the prompt rows of the
        requests at a step where it is on, without the skipped blocks:

            rows:  | r0 img0 | r0 img1 | r1 img0 |  r0 img0 | r0 img1 |  r0 img0 | r0 img1 |
                   |<---- prompt, R rows ---->|  |<- negative, U ->|  |<- skipped, S ->|
                                                                        (r1: no CFG)
        """
        guided = GuidedRows.of(requests, lambda r: has_cfg(r.params),
                               lambda r: r.params.guidance(DEFAULT_GUIDANCE))
        skip = self._skip_rows(requests)
        timestep = sigmas.float() * self.scheduler.num_train_timesteps      # (R,)
        x = latents.to(self.dtype)
        embeds, pooled = self._text(requests, "")
        calls = [Rows(x, embeds, pooled, timestep)]
        if guided.spans:
            idx = guided.idx.to(x.device)
            neg_embeds, neg_pooled = self._text(requests, "negative_", only_cfg=True)
            calls.append(Rows(x[idx], neg_embeds, neg_pooled, timestep[idx]))
        if skip:
            sidx = torch.tensor(skip, dtype=torch.long, device=x.device)
            calls.append(Rows(x[sidx], embeds[sidx], pooled[sidx], timestep[sidx],
                              self.skip_layer_guidance.layers))
        pos, *rest = self._forward(calls)
        pred = guided.mix(pos.clone(), rest[0]) if guided.spans else pos.clone()
        if skip:
            pred[sidx] = pred[sidx] + (pos[sidx] - rest[-1]) * self.skip_layer_guidance.scale
        return pred

    def _forward(self, calls: list[Rows]) -> list[Tensor]:
        """Each group of rows' transformer output. One rank: the groups that skip the same
        blocks in one call. CFG-parallel: the prompt rows on CFG rank 0, the others on rank 1,
        gathered on both."""
        sizes = [c.x.shape[0] for c in calls]
        out = run_branches(self.cfg_ranks, sizes, lambda chosen: self._run(
            [calls[b] for b in chosen]), calls[0].x)
        return list(out.split(sizes))

    def _run(self, calls: list[Rows]) -> Tensor:
        """The groups' outputs one after the other; consecutive groups that skip the same
        blocks share one call (from CUDA graphs when they are on: one per shape and set)."""
        forward = self.graphs if self.graphs is not None else self.transformer
        outs = []
        for _, same in itertools.groupby(calls, key=lambda c: c.skip_layers):
            group = list(same)
            x, embeds, pooled, t = (torch.cat(parts) for parts in zip(*(
                (c.x, c.embeds, c.pooled, c.timestep) for c in group)))
            outs.append(forward(x, embeds, pooled, t, skip_layers=group[0].skip_layers))
        return torch.cat(outs)

    def _skip_rows(self, requests: list[DiffusionRequest]) -> list[int]:
        """The rows on which skip-layer guidance runs this step (those of requests with CFG)."""
        skip: list[int] = []
        slg = self.skip_layer_guidance
        start = 0
        for r in requests:
            n = r.latents.shape[0]
            if has_cfg(r.params) and slg is not None and slg.is_active(r.step_idx, r.num_steps):
                skip += range(start, start + n)
            start += n
        return skip

    def _text(self, requests: list[DiffusionRequest], prefix: str, only_cfg: bool = False
              ) -> tuple[Tensor, Tensor]:
        """The requests' `prefix` embeds (rows, T, joint) and pooled (rows, P), one row per
        image (only_cfg: of the requests with CFG)."""
        chosen = [r for r in requests if not only_cfg or has_cfg(r.params)]
        embeds = torch.cat([r.cond[f"{prefix}prompt_embeds"].expand(r.latents.shape[0], -1, -1)
                            for r in chosen])
        pooled = torch.cat([r.cond[f"{prefix}pooled"].expand(r.latents.shape[0], -1)
                            for r in chosen])
        return embeds, pooled

    # ---- 3. decode -------------------------------------------------------------------------

    def decode_float(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """latents (n, C, h, w) -> float32 images (n, 3, H, W) in [0, 1], what diffusers
        returns for output_type="pt" (before the quantization of `decode`)."""
        z = self.vae.denormalize(latents.to(self.device, self.vae_dtype))   # (n, C, h, w)
        images = self.vae.decode_images(z)                  # (n, 3, H, W); tiles if huge
        return (images / 2 + 0.5).clamp(0, 1).float()
