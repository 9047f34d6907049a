"""Wan text-to-video, and Wan2.2 TI2V's text + first image: diffusers' `WanPipeline.__call__`
(and `WanImageToVideoPipeline.__call__` with `expand_timesteps`) split into the engine's phases
(omnistage/diffusion/pipeline.py), numerics kept step for step. The checkpoints it serves
differ by model_index.json (`WanVariant`):

    Wan2.1 T2V      one transformer
    Wan2.2 A14B     boundary_ratio: `transformer/` the high-noise expert for timesteps
                    >= boundary_ratio * num_train_timesteps with guidance_scale,
                    `transformer_2/` the low-noise one below with guidance_scale_2 (default:
                    guidance_scale); T2V here, I2V through wan_i2v.py
    Wan2.2 TI2V-5B  expand_timesteps: the 16x VAE (z48, 2x2 patchified), a timestep per token;
                    with a first image, its latent frame is the encoded image's and its
                    tokens' timestep 0

    encode:   UMT5 over each prompt padded to 512 tokens, the rows past the prompt zeroed
              (models/text_encoders/umt5.py encode_wan_prompts); the negative prompt the same
              way when guidance_scale > 1 (an unset one encodes as "")
    prepare:  randn (n, z, 1 + (F-1)/4, H/r, W/r) float32 on the request's CPU generator (r
              the VAE's factor, 8 or 16); the schedule of flow UniPC (solvers/unipc_flow.py:
              sigmas and the whole-number timesteps the transformer is fed, kept in the
              request's cond); TI2V's first image: VAE-encoded (the posterior mean),
              normalized, cond["image_latents"] (1, z, 1, h, w)
    velocity: the rows grouped by expert (a request crosses the boundary mid-schedule, others
              in its batch may be on the other side), per expert one transformer call over
              every row's prompt, then the guided rows again with their negative prompt, the
              input being `model_inputs` of each row (TI2V: its first frame the image's);
              comb = uncond + g * (cond - uncond), g that expert's scale
    finish:   TI2V's first latent frame set to the image's again (the solver stepped its own)
    decode:   denormalize -> the causal video VAE -> (x/2 + 0.5).clamp(0, 1) -> uint8
              (n, F, H, W, 3), a stage's tensors["video"]

Each request steps with its own UniPC state (the engine holds it, `solver`). Step caching
(the request's cache_threshold) keeps a state per request, branch (cond, uncond) and
expert; each expert's forward replays from its own CUDA graphs when the stage turns them
on, except on steps that cache and with a timestep per token. Image-to-video (diffusers'
`WanImageToVideoPipeline`: Wan2.1 I2V with CLIP image tokens, Wan2.2 I2V-A14B with two
experts) is this pipeline with a conditioned input (wan_i2v.py): its VideoSpec asks for a
first frame, which `validate` enforces, and its `model_inputs` puts the first frame's mask and
latents beside each row's latents and adds the CLIP image tokens; the experts, guidance, step
caching, CUDA graphs, solver and decode are the ones here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor
from transformers import AutoTokenizer

from omnistage.diffusion.image_input import input_image, preprocess
from omnistage.diffusion.cfg import GuidedRows, run_branches
from omnistage.diffusion.params import DiffusionParams, check_size
from omnistage.diffusion.pipeline import (DiffusionPipeline, check_conditioning,
                                         encode_with_negatives)
from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion.solvers.unipc_flow import FlowUniPC, UniPCConfig
from omnistage.layers.graph_capture import ShapeGraphs
from omnistage.layers.groups import stage_ranks
from omnistage.layers.step_cache import cache_groups
from omnistage.models.autoencoder_kl_wan import AutoencoderKLWan, AutoencoderKLWanConfig
from omnistage.models.diffusers_loader import read_config
from omnistage.models.text_encoders import UMT5Encoder, encode_wan_prompts
from omnistage.models.wan_transformer import WanTransformer3DModel, WanTransformerConfig
from omnistage.registry import VideoSpec

DEFAULT_GUIDANCE = 5.0          # diffusers' WanPipeline default
MAX_SIZE = 1280
# Wan2.1 and Wan2.2 A14B: 480p by default (diffusers' defaults), 5 s at 16 fps
SPEC = VideoSpec(default_size=(832, 480), size_multiple=16, default_num_frames=81,
                 max_num_frames=81, frame_multiple=4, frame_offset=1, fps=16)
# Wan2.2 TI2V-5B: trained at 1280x704, 5 s at 24 fps; text or text + first image
TI2V_SPEC = VideoSpec(default_size=(1280, 704), size_multiple=32, default_num_frames=121,
                      max_num_frames=121, frame_multiple=4, frame_offset=1, fps=24,
                      image_to_video=True)


@dataclass(frozen=True, slots=True)
class WanVariant:
    """model_index.json's switches between the checkpoints diffusers' `WanPipeline` loads (see
    the module docstring); a folder without the keys is Wan2.1."""

    boundary_ratio: float | None = None
    expand_timesteps: bool = False

    @classmethod
    def read(cls, path: str | Path) -> WanVariant:
        index = Path(path) / "model_index.json"
        raw = json.loads(index.read_text()) if index.is_file() else {}
        ratio = raw.get("boundary_ratio")
        if ratio is not None and not 0.0 < ratio < 1.0:
            raise ValueError(f"{index}: boundary_ratio={ratio} is not in (0, 1)")
        return cls(ratio, bool(raw.get("expand_timesteps", False)))

    def spec(self, vae: AutoencoderKLWanConfig, patch: int) -> VideoSpec:
        """What /v1/videos may ask: sizes a multiple of the VAE's factor times the patch, frame
        counts 1 + the VAE's temporal factor k."""
        base = TI2V_SPEC if self.expand_timesteps else SPEC
        return replace(base, size_multiple=vae.downscale * patch,
                       frame_multiple=vae.temporal_downscale)


def video_spec(path: str | Path) -> VideoSpec:
    """What /v1/videos may ask of a Wan folder (T2V, A14B or TI2V), read from its configs."""
    path = Path(path)
    vae = AutoencoderKLWanConfig.from_dict(read_config(path / "vae"))
    transformer = WanTransformerConfig.from_dict(read_config(path / "transformer"))
    return WanVariant.read(path).spec(vae, transformer.patch_size[1])


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


class WanPipeline(DiffusionPipeline):
    label = "Wan"
    graphable = True        # a stage's `cuda_graphs` option: use_cuda_graphs
    graphs: list[ShapeGraphs] | None = None          # per expert
    # CFG-parallel: the prompt rows on CFG rank 0, the negative prompt's on rank 1; Ulysses,
    # ring and TP inside the transformer (models/wan_transformer.py), every rank the same call
    parallel_axes = ("cfg", "ulysses", "ring", "tp")
    splits_text = True

    def __init__(self, transformer: WanTransformer3DModel, vae: AutoencoderKLWan,
                 prompt_encoder: WanPromptEncoder, solver: FlowUniPC, device: torch.device,
                 transformer_2: WanTransformer3DModel | None = None,
                 variant: WanVariant = WanVariant()) -> None:
        if (variant.boundary_ratio is None) != (transformer_2 is None):
            raise ValueError("transformer_2 and boundary_ratio come together (Wan2.2 A14B's "
                             f"low-noise expert and where it starts), got {variant} with "
                             f"transformer_2 {'given' if transformer_2 else 'absent'}")
        self.transformer = transformer.to(device).eval()
        self.transformer_2 = None if transformer_2 is None else transformer_2.to(device).eval()
        self.experts = [m for m in (self.transformer, self.transformer_2) if m is not None]
        self.cfg_ranks = stage_ranks().cfg      # CFG-parallel: branch c runs on rank c
        if transformer_2 is not None:    # 14B T2V-shaped, yet not Wan2.1: its own indicator
            for m in self.experts:
                m.published_teacache = False
        self.vae = vae.to(device).eval()
        self.prompt_encoder = prompt_encoder
        self.solver = solver                     # the engine steps every request with it
        self.device = device
        # the compute dtype: the patch embedding's (the first parameter, scale_shift_table,
        # stays float32 in any dtype, as diffusers keeps it)
        self.dtype = transformer.patch_embedding.weight.dtype
        self.variant = variant
        self.patch = transformer.cfg.patch_size
        self.video = variant.spec(vae.cfg, self.patch[1])
        # diffusers: boundary_ratio * num_train_timesteps, compared with the int timestep
        self.boundary = (None if variant.boundary_ratio is None
                         else variant.boundary_ratio * solver.cfg.num_train_timesteps)

    @classmethod
    def from_pretrained(cls, path: str | Path, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True) -> WanPipeline:
        """A diffusers Wan folder: transformer/ (and transformer_2/ with a boundary_ratio),
        vae/ (float32, as diffusers runs it), text_encoder/ + tokenizer/ and scheduler/ (flow
        UniPC); model_index.json says the variant."""
        path = Path(path)
        variant = WanVariant.read(path)
        if not (path / "transformer").is_dir():   # diffusers would call None at high noise
            raise ValueError(f"{path}: no transformer/ (a folder with only the low-noise "
                             "expert, transformer_2/, is not supported)")
        transformer = WanTransformer3DModel.from_pretrained(path / "transformer", device, dtype)
        transformer_2 = (None if variant.boundary_ratio is None else
                         WanTransformer3DModel.from_pretrained(path / "transformer_2", device,
                                                               dtype))
        vae = AutoencoderKLWan.from_pretrained(path / "vae", device, torch.float32)
        encoder = WanPromptEncoder.from_pretrained(path, device, dtype)
        solver = FlowUniPC(UniPCConfig.from_json(path / "scheduler" / "scheduler_config.json"))
        return cls(transformer, vae, encoder, solver, device, transformer_2, variant)

    def _shape(self, params: DiffusionParams) -> tuple[int, int, int]:
        """(frames, height, width) asked, or the defaults."""
        width, height = self.video.default_size
        return (params.num_frames or self.video.default_num_frames, params.height or height,
                params.width or width)

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        if prompt is not None:
            self.prompt_encoder.validate(prompt, params)
        has_image = image is not None or params.image is not None
        if has_image and not self.video.image_to_video:
            raise ValueError("image: this Wan checkpoint makes video from text only")
        if not has_image and not self.video.text_to_video:
            raise ValueError("image: this Wan checkpoint makes video from a first frame, which "
                             "the request lacks (/v1/videos: input_reference)")
        if params.guidance_scale_2 is not None and self.transformer_2 is None:
            raise ValueError("guidance_scale_2: this Wan checkpoint has one transformer (no "
                             "boundary_ratio, not Wan2.2 A14B); use guidance_scale")
        frames, height, width = self._shape(params)
        t = self.vae.cfg.temporal_downscale
        if (frames - 1) % t:
            raise ValueError(f"num_frames={frames}: must be 1 + a multiple of {t} (the VAE's "
                             "temporal factor)")
        check_size(height, width, self.video.size_multiple, MAX_SIZE,
                   f"VAE factor {self.vae.cfg.downscale} x {self.patch[1]}x{self.patch[2]} "
                   "patches")

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Encode the prompt(s); the latents (float32 noise), UniPC's schedule and, for TI2V
        with a first image, its latents."""
        (cond,) = self.prompt_encoder.encode([prompt], [params])
        frames, height, width = self._shape(params)
        cfg = self.vae.cfg
        shape = (params.num_images, cfg.z_dim,
                 1 + (frames - 1) // cfg.temporal_downscale, height // cfg.downscale,
                 width // cfg.downscale)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        sigmas, timesteps = self.solver.make_sigmas(params.num_inference_steps,
                                                    params.flow_shift)
        expected = {k: (2, self.transformer.cfg.text_dim) for k in cond}
        cond = {**check_conditioning(cond, expected, self.device, self.dtype),
                "timesteps": timesteps}
        image = input_image(params, image) if self.variant.expand_timesteps else None
        if image is not None:
            cond["image_latents"] = self.encode_first_frame(image, height, width)
        return latents, sigmas, cond

    def encode_first_frame(self, image: Image.Image, height: int, width: int) -> Tensor:
        """TI2V's first image -> its normalized latents (1, z, 1, h, w) float32: resized as
        diffusers' video processor does, the VAE's posterior mean (`sample_mode="argmax"`)."""
        pixels = preprocess(image, height, width).to(self.device, torch.float32)
        return self.vae.normalize(self.vae.encode(pixels.unsqueeze(2)))

    def expert(self, request: DiffusionRequest) -> int:
        """Which transformer takes the request's current step: 0 (`transformer`: the only one,
        or A14B's high-noise expert at timesteps >= the boundary), 1 (`transformer_2`, below)."""
        if self.boundary is None:
            return 0
        ratio = request.params.boundary_ratio
        boundary = self.boundary if ratio is None else \
            ratio * self.solver.cfg.num_train_timesteps
        return 0 if bool(request.cond["timesteps"][request.step_idx] >= boundary) else 1

    def unused_params(self, params: DiffusionParams) -> dict[str, str]:
        """flow_shift is used; boundary_ratio only by Wan2.2 A14B's two experts."""
        if params.boundary_ratio is not None and self.boundary is None:
            return {"boundary_ratio": "this Wan model has one transformer (no expert switch)"}
        return {}

    def guidance_scale(self, params: DiffusionParams, expert: int) -> float:
        """guidance_scale, or on the low-noise expert guidance_scale_2 if given."""
        scale = params.guidance(DEFAULT_GUIDANCE)
        return scale if expert == 0 or params.guidance_scale_2 is None \
            else params.guidance_scale_2

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """Each expert over the rows of its requests (one call each; A14B's requests may
        be on either side of the boundary), see `expert_velocity`."""
        experts = [self.expert(r) for r in requests]
        if len(set(experts)) == 1:
            return self.expert_velocity(experts[0], latents, requests)
        rows = torch.arange(latents.shape[0], device=latents.device).split(
            [r.latents.shape[0] for r in requests])
        out = None
        for e in sorted(set(experts)):
            mine = [i for i, x in enumerate(experts) if x == e]
            idx = torch.cat([rows[i] for i in mine])
            pred = self.expert_velocity(e, latents[idx], [requests[i] for i in mine])
            out = pred.new_empty((latents.shape[0], *pred.shape[1:])) if out is None else out
            out[idx] = pred
        return out

    def expert_velocity(self, expert: int, latents: Tensor, requests: list[DiffusionRequest]
                        ) -> Tensor:
        """Every row with its prompt, then the guided rows with their negative prompt, in one
        call of transformer `expert` at each request's whole-number timestep."""
        counts = [r.latents.shape[0] for r in requests]
        grid = self._grid(latents.shape)
        guided = GuidedRows.of(requests, lambda r: "negative_prompt_embeds" in r.cond,
                               lambda r: self.guidance_scale(r.params, expert))
        texts, neg_texts, steps, neg_steps = [], [], [], []
        rows: list[DiffusionRequest] = []            # the request of each transformer row
        neg_rows: list[DiffusionRequest] = []
        for r, n, g in zip(requests, counts, guided.guided):
            t = self._timesteps(r, n, grid)
            texts += [r.cond["prompt_embeds"]] * n
            rows += [r] * n
            steps.append(t)
            if g:
                neg_texts += [r.cond["negative_prompt_embeds"]] * n
                neg_rows += [r] * n
                neg_steps.append(t)
        x = torch.cat([latents, latents[guided.idx.to(latents.device)]])
        x, image = self.model_inputs(x, rows + neg_rows)
        t = torch.cat(steps + neg_steps).to(self.device)
        text = torch.stack(texts + neg_texts)
        branches = guided.branches(str(expert))
        cached = any(r.params.cache_threshold is not None for r in requests)
        num_rows = latents.shape[0]
        parts = [slice(0, num_rows), slice(num_rows, x.shape[0])]

        def run(chosen: list[int]) -> Tensor:           # rows of a branch are contiguous
            part = slice(parts[chosen[0]].start, parts[chosen[-1]].stop)
            return self.run_expert(
                expert, x[part].to(self.dtype), t[part], text[part],
                None if image is None else image[part],
                cache_groups(requests, counts, [branches[b] for b in chosen]) if cached else None)

        out = run_branches(self.cfg_ranks, [num_rows, x.shape[0] - num_rows], run, latents)
        return guided.mix(out[:num_rows], out[num_rows:])

    def model_inputs(self, x: Tensor, rows: list[DiffusionRequest]
                     ) -> tuple[Tensor, Tensor | None]:
        """The transformer's input and image tokens for latents x (R, z, F', h, w) whose row i
        belongs to rows[i]: x as is (TI2V: a first image's latents as frame 0, see
        `with_first_frame`), no image tokens."""
        if not self.variant.expand_timesteps:
            return x, None
        return torch.cat([self.with_first_frame(x[i:i + 1], r)
                          for i, r in enumerate(rows)]), None

    def _grid(self, shape: torch.Size) -> tuple[int, int, int]:
        """Latents (n, z, F', h, w) -> the transformer's token grid."""
        return tuple(n // p for n, p in zip(shape[2:], self.patch))

    def _timesteps(self, request: DiffusionRequest, n: int, grid: tuple[int, int, int]
                   ) -> Tensor:
        """The request's timestep for each of its n rows: (n,); with expand_timesteps (n, N)
        float32, one per token, 0 on a first image's frame (diffusers' `mask * t`)."""
        t = request.cond["timesteps"][request.step_idx]
        if not self.variant.expand_timesteps:
            return t.expand(n)
        mask = torch.ones(grid, dtype=torch.float32)
        if "image_latents" in request.cond:
            mask[0] = 0
        return (mask * t).flatten().expand(n, -1)

    @staticmethod
    def with_first_frame(latents: Tensor, request: DiffusionRequest) -> Tensor:
        """latents (n, z, F', h, w) of the request with TI2V's first image: their first frame
        the image's latents (what diffusers' `(1 - mask) * condition + mask * latents`
        gives); the latents as they are otherwise."""
        image = request.cond.get("image_latents")
        if image is None:
            return latents
        image = image.to(latents.dtype).expand(latents.shape[0], -1, -1, -1, -1)
        return torch.cat([image, latents[:, :, 1:]], dim=2)

    def final_latents(self, request: DiffusionRequest) -> Tensor:
        """A finished request's latents, what `decode` takes (the engine asks)."""
        return self.with_first_frame(request.latents, request)

    def denoisers(self) -> list[torch.nn.Module]:
        """Both of Wan2.2 A14B's experts (one for the others)."""
        return list(self.experts)

    def use_cuda_graphs(self, max_graphs: int = 8) -> None:
        """Replay each expert's forward from its own CUDA graphs (layers/graph_capture.py
        ShapeGraphs), one per shape seen twice: a stage's `diffusion: {cuda_graphs: ...}`."""
        self.graphs = [ShapeGraphs(m, max_graphs) for m in self.experts]

    def run_expert(self, expert: int, x: Tensor, t: Tensor, text: Tensor,
                   image: Tensor | None = None, step_cache: object = None) -> Tensor:
        """Transformer `expert`'s forward (image: Wan2.1 I2V's CLIP tokens): from its CUDA
        graphs when they are on, except for a step-cached call (its blocks run or not per
        request) and a timestep per token (TI2V's first frame at 0: finding the distinct values
        syncs the host, which a graph cannot)."""
        if self.graphs is not None and step_cache is None and t.dim() == 1:
            return self.graphs[expert](x, t, text, image)
        return self.experts[expert](x, t, text, image, step_cache=step_cache)

    def decode(self, latents: Tensor, params: DiffusionParams) -> Tensor:
        """-> uint8 (n, F, H, W, 3)."""
        z = self.vae.denormalize(latents.to(self.device, torch.float32))
        video = (self.vae.decode(z) / 2 + 0.5).clamp(0, 1)                # (n, 3, F, H, W)
        return (video * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()
