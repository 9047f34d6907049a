"""LTX-2 text-to-video with sound: diffusers' `LTX2Pipeline.__call__` split into the engine's
phases (omnistage/diffusion/pipeline.py), numerics kept step for step. One transformer denoises
the video and the audio latents together; the answer is frames and a waveform.

    encode:   Gemma3 over each prompt (left-padded), its hidden layers stacked, then the text
              connectors (LTX2PromptEncoder): per request prompt_embeds and
              audio_prompt_embeds (L, caption_channels) with prompt_attention_mask (L,); the
              negative prompt's too when guided (an unset one encodes as "")
    prepare:  randn video (n, C, 1 + (F-1)/8, H/32, W/32) then audio (n, Ca, T, mel/4) float32
              on the request's CPU generator, each packed to tokens (n, N, C) / (n, T, Ca*mel/4)
              and held side by side in one row (n, N*C + T*Ca*mel/4): the engine's Euler step
              is elementwise with one schedule, and both of diffusers' schedulers are copies.
              T = round(F / fps * sample_rate / hop / 4). Schedule: sigmas linspace(1, 1/N, N)
              shifted by mu(N video tokens) (solvers/flow_match_euler.py)
    velocity: per group of requests with the same grid and fps (rope positions), one
              transformer call over every row with its prompt and the guided rows with their
              negative prompt, and, with modality guidance, one more over the prompt rows with
              the audio-video attention off. Guidance in x0 space (x0 = x - sigma v), for video
              and audio each with its own scales:
                  x0 = x0_c + (g - 1)(x0_c - x0_u) + (m - 1)(x0_c - x0_iso)
              then rescaled toward x0_c's std by `rescale` (diffusers' rescale_noise_cfg) and
              turned back into a velocity
    decode:   video: unpack, denormalize, the video VAE -> (x/2 + 0.5).clamp(0, 1) -> uint8
              (n, F, H, W, 3); audio: denormalize, unpack, the audio VAE -> mel -> the vocoder
              -> float32 (n, channels, samples) at its rate: one Payload (payloads.py: Video and
              AudioChunk)

Step caching (the request's cache_threshold) keeps a state per request and branch (cond,
uncond, and "iso", the modality pass), over the video and audio streams as one
(models/ltx2_transformer.py).

Per request: guidance_scale (the video's, 3.0 by default as diffusers), num_frames (1 + 8k),
fps (24), height and width (multiples of 32). The audio guidance, modality guidance and rescale
scales are the stage's `diffusion.options` (`LTX2Options`, diffusers' defaults), and the
distilled schedule and two-stage recipe (`schedule`, `upsample`: ltx2_two_stage.py; a
request's `upsample` picks the recipe for itself on a folder with a latent upsampler).
Spatio-temporal guidance (STG: options stg_scale, audio_stg_scale, stg_blocks) runs one more
forward over the prompt rows with the self-attentions of stg_blocks skipped, x0 += s (x0_c -
x0_stg), for a transformer whose config has perturbed_attn; LTX-2.0's has not, and diffusers'
"perturbed" pass is then the conditional one again (no term), so none is run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.cfg import GuidedRows, run_branches
from omnistage.diffusion.params import DiffusionParams, check_size
from omnistage.diffusion.pipeline import DiffusionPipeline, check_conditioning, forward_by_key
from omnistage.diffusion.pipelines.ltx2_options import Layout, LTX2Options, rescale
from omnistage.diffusion.pipelines.ltx2_text import TEXT_KEYS, LTX2PromptEncoder
from omnistage.diffusion.pipelines.ltx2_two_stage import (DISTILLED_SIGMAS, UPSAMPLER,
                                                          base_side, check_upsample,
                                                          distilled_sigmas, load_upsampler,
                                                          refine)
from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion.solvers.flow_match_euler import (FlowMatchEuler, FlowMatchEulerConfig,
                                                          calculate_shift, make_sigmas)
from omnistage.layers.groups import stage_ranks
from omnistage.layers.step_cache import CacheGroup, cache_groups
from omnistage.models.autoencoder_kl_ltx2 import AutoencoderKLLTX2Video
from omnistage.models.autoencoder_kl_ltx2_audio import DOWNSAMPLE, AutoencoderKLLTX2Audio
from omnistage.models.diffusers_loader import read_config
from omnistage.models.ltx2_latent_upsampler import LTX2LatentUpsampler
from omnistage.models.ltx2_transformer import LTX2TransformerConfig, LTX2VideoTransformer3DModel
from omnistage.models.ltx2_vocoder import LTX2Vocoder, LTX2VocoderWithBWE, load_vocoder
from omnistage.payloads import AudioChunk, Payload, Video
from omnistage.registry import VideoSpec

__all__ = ["LTX2Options", "Layout", "LTX2Pipeline", "SPEC", "video_spec"]

DEFAULT_GUIDANCE = 3.0          # diffusers' LTX2Pipeline default (video)
MAX_SIZE = 2048
# 768x512 by default (diffusers' default), 121 frames at 24 fps (~5 s); up to ~10.7 s
SPEC = VideoSpec(default_size=(768, 512), size_multiple=32, default_num_frames=121,
                 max_num_frames=257, frame_multiple=8, frame_offset=1, fps=24, audio=True)


def video_spec(path: str | Path) -> VideoSpec:
    """What /v1/videos may ask of an LTX-2 folder: LTX-2's rule (1 + 8k frames, sides of 32),
    and the two-stage recipe where the folder has a latent upsampler."""
    LTX2TransformerConfig.from_dict(read_config(Path(path) / "transformer"))   # refuse early
    has_upsampler = (Path(path) / UPSAMPLER / "config.json").is_file()
    return dataclasses.replace(SPEC, upsample=True) if has_upsampler else SPEC


class LTX2Pipeline(DiffusionPipeline):
    label = "LTX-2"
    Options = LTX2Options
    # CFG-parallel: the prompt rows on CFG rank 0, the negative prompt's on rank 1
    parallel_axes = ("cfg",)
    splits_text = True

    def __init__(self, transformer: LTX2VideoTransformer3DModel, vae: AutoencoderKLLTX2Video,
                 audio_vae: AutoencoderKLLTX2Audio, vocoder: LTX2Vocoder | LTX2VocoderWithBWE,
                 scheduler: FlowMatchEulerConfig, device: torch.device,
                 prompt_encoder: LTX2PromptEncoder | None = None,
                 upsampler: LTX2LatentUpsampler | None = None) -> None:
        self.transformer = transformer.to(device).eval()
        self.vae = vae.to(device).eval()
        self.audio_vae = audio_vae.to(device).eval()
        self.vocoder = vocoder.to(device).eval()
        self.scheduler = scheduler
        self.solver = FlowMatchEuler()
        self.device = device
        self.dtype = transformer.proj_in.weight.dtype
        self.prompt_encoder = prompt_encoder
        self.upsampler = upsampler
        if prompt_encoder is not None:
            prompt_encoder.guided = self.guided
        self.options = LTX2Options()
        self.cfg_ranks = stage_ranks().cfg
        self.video = SPEC

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str, device: torch.device,
                        dtype: torch.dtype | None, text_encoders: bool = True) -> LTX2Pipeline:
        """A diffusers LTX-2 folder: transformer/, vae/, audio_vae/, vocoder/ (float32, as the
        tests run diffusers; the decoders stay float32 in any dtype), scheduler/ (flow-match
        Euler), and text_encoder/ + tokenizer/ + connectors/ unless text_encoders is False."""
        path = Path(path)
        transformer = LTX2VideoTransformer3DModel.from_pretrained(path / "transformer", device,
                                                                  dtype)
        vae = AutoencoderKLLTX2Video.from_pretrained(path / "vae", device, torch.float32)
        audio_vae = AutoencoderKLLTX2Audio.from_pretrained(path / "audio_vae", device,
                                                           torch.float32)
        vocoder = load_vocoder(path / "vocoder", device, torch.float32)
        scheduler = FlowMatchEulerConfig.from_json(path / "scheduler" / "scheduler_config.json")
        encoder = cls.load_prompt_encoder(path, device, dtype) if text_encoders else None
        return cls(transformer, vae, audio_vae, vocoder, scheduler, device, encoder,
                   load_upsampler(path, device))

    @classmethod
    def load_prompt_encoder(cls, path: str | Path, device: torch.device,
                            dtype: torch.dtype | None) -> LTX2PromptEncoder:
        return LTX2PromptEncoder.from_pretrained(path, device, dtype)

    def configure(self, options: LTX2Options) -> None:
        if options.upsample:
            check_upsample(self.upsampler, self.cfg_ranks.world_size)
        self.options = options

    @property
    def default_guidance(self) -> float:
        """The video's CFG when a request sets none: diffusers' 3, the distilled schedule's 1."""
        return 1.0 if self.options.schedule == "distilled" else DEFAULT_GUIDANCE

    # ---- checks and latents ----------------------------------------------------------------

    def _shape(self, params: DiffusionParams) -> tuple[int, int, int, float]:
        """(frames, height, width, fps) asked, or the defaults."""
        width, height = self.video.default_size
        return (params.num_frames or self.video.default_num_frames, params.height or height,
                params.width or width, params.fps or float(self.video.fps))

    def validate(self, prompt: str | None, params: DiffusionParams,
                 image: Image.Image | None = None) -> None:
        if prompt is not None and not prompt.strip():
            raise ValueError("prompt: must be non-empty")
        if image is not None or params.image is not None:
            raise ValueError("image: LTX-2 text-to-video takes no input image")
        frames, height, width, _ = self._shape(params)
        t = self.vae.cfg.temporal_ratio
        if (frames - 1) % t or frames > self.video.max_num_frames:
            raise ValueError(f"num_frames={frames}: must be 1 + a multiple of {t} (the VAE's "
                             f"temporal factor), at most {self.video.max_num_frames}")
        check_size(height, width, self.video.size_multiple, MAX_SIZE,
                   f"the VAE's factor {self.vae.cfg.spatial_ratio}, and diffusers' rule of 32")
        if params.upsample and not self.options.upsample:
            try:
                check_upsample(self.upsampler, self.cfg_ranks.world_size)
            except ValueError as exc:
                raise ValueError(f"upsample: {exc}") from None
        if self.two_stage(params):
            for name, side in (("height", height), ("width", width)):
                try:
                    base_side(side, self.upsampler.cfg.spatial_factor, self.video.size_multiple)
                except ValueError as exc:
                    raise ValueError(f"{name}={exc}") from None

    def layout(self, params: DiffusionParams, final: bool = False) -> Layout:
        """The latent row of a request: of the base loop, or (final) of what is decoded; they
        differ with the two-stage recipe (`two_stage`), whose base runs smaller."""
        frames, height, width, fps = self._shape(params)
        if self.two_stage(params) and not final:
            factor = self.upsampler.cfg.spatial_factor
            height, width = (base_side(height, factor, self.video.size_multiple),
                             base_side(width, factor, self.video.size_multiple))
        s, t = self.vae.cfg.spatial_ratio, self.vae.cfg.temporal_ratio
        cfg = self.audio_vae.cfg
        per_second = cfg.sample_rate / cfg.mel_hop_length / float(DOWNSAMPLE)
        return Layout(((frames - 1) // t + 1, height // s, width // s),
                      self.transformer.cfg.in_channels, round(frames / fps * per_second),
                      cfg.latent_channels * self.audio_vae.latent_mel_bins, fps)

    def prepare_latents(self, params: DiffusionParams, generator: torch.Generator,
                        image: Image.Image | None = None
                        ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Video noise, then audio noise, from the request's generator (diffusers' order),
        side by side in one row per video; the shifted schedule."""
        lay, n = self.layout(params), params.num_images
        video = self.initial_video(lay, n, generator, params, image)         # (n, C, F', h, w)
        audio = torch.randn((n, self.audio_vae.cfg.latent_channels, lay.audio_frames,
                             self.audio_vae.latent_mel_bins), generator=generator)
        video = video.flatten(2).transpose(1, 2)                                  # (n, N, C)
        audio = audio.transpose(1, 2).flatten(2)                                  # (n, T, Ca)
        steps, cfg = params.num_inference_steps, self.scheduler
        mu = calculate_shift(video.shape[1], cfg.base_image_seq_len, cfg.max_image_seq_len,
                             cfg.base_shift, cfg.max_shift)
        sigmas = distilled_sigmas(cfg) if self.options.schedule == "distilled" else \
            make_sigmas(cfg, steps, mu, np.linspace(1.0, 1 / steps, steps))[0]
        return Layout.join(video, audio).to(self.device), sigmas, {}

    def initial_video(self, lay: Layout, n: int, generator: torch.Generator,
                      params: DiffusionParams, image: Image.Image | None) -> Tensor:
        """The video latents a request starts from: noise (image-to-video: its first frame
        the image's latents)."""
        return torch.randn((n, lay.channels, *lay.grid), generator=generator)

    def prepare(self, prompt: str, params: DiffusionParams, generator: torch.Generator,
                image: Image.Image | None = None) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        (cond,) = self.prompt_encoder.encode([prompt], [params])
        latents, sigmas, _ = self.prepare_latents(params, generator, image)
        return latents, sigmas, self.check_conditioning(cond, params)

    def unused_params(self, params: DiffusionParams) -> dict[str, str]:
        """The schedule fields (the base class's), Wan's and Qwen-Image's guidance fields, and
        a negative prompt without guidance (diffusers then ignores it)."""
        out = super().unused_params(params)
        if params.guidance_scale_2 is not None:
            out["guidance_scale_2"] = "LTX-2 has one transformer; use guidance_scale"
        if params.true_cfg_scale != 1.0:
            out["true_cfg_scale"] = "LTX-2's CFG is guidance_scale (audio: the stage's option)"
        if params.negative_prompt is not None and not self.guided(params):
            out["negative_prompt"] = "no guidance: guidance_scale and audio_guidance_scale <= 1"
        if self.options.schedule == "distilled" and \
                params.num_inference_steps != len(DISTILLED_SIGMAS):
            out["num_inference_steps"] = f"the distilled schedule has {len(DISTILLED_SIGMAS)}"
        return out

    def guided(self, params: DiffusionParams) -> bool:
        """diffusers' do_classifier_free_guidance: either modality's scale above 1."""
        return params.guidance(self.default_guidance) > 1 or \
            self.options.audio_guidance_scale > 1

    def check_conditioning(self, tensors: dict[str, Tensor], params: DiffusionParams
                           ) -> dict[str, Tensor]:
        """The text stage's tensors: TEXT_KEYS, and their negatives when guided (those of
        a text stage that guides by other options dropped otherwise)."""
        if not self.guided(params):
            tensors = {k: v for k, v in tensors.items() if not k.startswith("negative_")}
        width = self.transformer.cfg.caption_channels
        keys = TEXT_KEYS + (tuple(f"negative_{k}" for k in TEXT_KEYS)
                            if self.guided(params) else ())
        expected = {k: (1, tensors[k].shape[-1]) if k.endswith("mask") and k in tensors
                    else (2, width) for k in keys}
        return check_conditioning(tensors, expected, self.device, self.dtype)

    # ---- the denoising step ----------------------------------------------------------------

    def velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                 ) -> Tensor:
        """Requests grouped by what the rope needs (grid, fps), see `_velocity`."""
        return forward_by_key(latents, sigmas, requests, lambda r: self.layout(r.params),
                              self._velocity)

    def _velocity(self, latents: Tensor, sigmas: Tensor, requests: list[DiffusionRequest]
                  ) -> Tensor:
        return self.velocity_at(self.layout(requests[0].params), latents, sigmas, requests)

    def velocity_at(self, lay: Layout, latents: Tensor, sigmas: Tensor,
                    requests: list[DiffusionRequest]) -> Tensor:
        guided = GuidedRows.of(requests, lambda r: "negative_prompt_embeds" in r.cond,
                               lambda r: 1.0)
        counts = [r.latents.shape[0] for r in requests]
        rows = [r for r, n in zip(requests, counts) for _ in range(n)]
        neg_rows = [r for r, n, g in zip(requests, counts, guided.guided) if g
                    for _ in range(n)]
        x = torch.cat([latents, latents[guided.idx.to(latents.device)]])
        text = self._text(rows, "")
        if neg_rows:
            text = [torch.cat(pair) for pair in zip(text, self._text(neg_rows, "negative_"))]
        t = torch.cat([sigmas, sigmas[guided.idx.to(sigmas.device)]]) * \
            self.scheduler.num_train_timesteps
        parts = [slice(0, len(rows)), slice(len(rows), x.shape[0])]
        cached = any(r.params.cache_threshold is not None for r in requests)
        branches = guided.branches() + [("iso", [True] * len(requests))]

        def cache(chosen: list[int]) -> list[CacheGroup] | None:
            return cache_groups(requests, counts, [branches[b] for b in chosen]) \
                if cached else None

        def run(chosen: list[int]) -> Tensor:
            part = slice(parts[chosen[0]].start, parts[chosen[-1]].stop)
            return self._forward(lay, x[part], t[part], [c[part] for c in text],
                                 step_cache=cache(chosen))

        out = run_branches(self.cfg_ranks, [len(rows), x.shape[0] - len(rows)], run, latents)
        cond = (t[:len(rows)], [c[:len(rows)] for c in text])
        isolated = (self._forward(lay, latents, *cond, isolate=True, step_cache=cache([2]))
                    if self.options.modality else None)
        perturbed = self._forward(lay, latents, *cond, stg=True) if self.stg else None
        return self._guide(lay, latents, sigmas, out, (isolated, perturbed), guided, rows)

    @property
    def stg(self) -> bool:
        """STG's extra forward runs: a scale above 0 and a block it can perturb."""
        opt, n = self.options, len(self.transformer.transformer_blocks)
        return (opt.stg_scale > 0 or opt.audio_stg_scale > 0) and \
            self.transformer.cfg.perturbed_attn and any(0 <= b < n for b in opt.stg_blocks)

    def _text(self, rows: list[DiffusionRequest], prefix: str) -> list[Tensor]:
        """The rows' video text, audio text and mask, stacked (R, L, ...)."""
        return [torch.stack([r.cond[prefix + k] for r in rows]) for k in TEXT_KEYS]

    def _forward(self, lay: Layout, x: Tensor, t: Tensor, text: list[Tensor],
                 isolate: bool = False, step_cache: list[CacheGroup] | None = None,
                 stg: bool = False) -> Tensor:
        """One transformer call over rows x (R, S) at timesteps t (R,) -> velocities (R, S)."""
        video, audio = lay.split(x.to(self.dtype))
        t = t.to(self.device)
        v, a = self.transformer(video, audio, text[0], text[1], self.video_timesteps(lay, t),
                                lay.positions, audio_timestep=t, encoder_attention_mask=text[2],
                                use_cross_timestep=True, isolate_modalities=isolate, sigma=t,
                                step_cache=step_cache,
                                stg_blocks=self.options.stg_blocks if stg else ())
        return Layout.join(v.float(), a.float())

    def video_timesteps(self, lay: Layout, t: Tensor) -> Tensor:
        """The video tokens' timesteps for rows at t (R,): the row's (image-to-video: one
        per token, the first frame's 0)."""
        return t

    def _guide(self, lay: Layout, latents: Tensor, sigmas: Tensor, out: Tensor,
               extra: tuple[Tensor | None, Tensor | None], guided: GuidedRows,
               rows: list[DiffusionRequest]) -> Tensor:
        """diffusers' guidance in x0 space, video and audio each with their own scales;
        extra: the modality pass's and STG's velocities (None: not run)."""
        isolated, perturbed = extra
        opt = self.options
        num = latents.shape[0]
        sigma = sigmas.reshape(-1, 1).to(latents.device)
        x0 = latents - out[:num] * sigma                                          # (R, S)
        x0_g = x0.clone()
        for rs, x0_u, _ in guided.pairs(x0, latents[guided.idx] - out[num:] *
                                        sigma[guided.idx]):
            g = rows[rs.start].params.guidance(self.default_guidance)
            scales = self._scales(lay, g - 1, opt.audio_guidance_scale - 1)
            x0_g[rs] += scales * (x0[rs] - x0_u)
        if perturbed is not None:
            scales = self._scales(lay, opt.stg_scale, opt.audio_stg_scale)
            x0_g += scales * (x0 - (latents - perturbed * sigma))
        if isolated is not None:
            scales = self._scales(lay, opt.modality_scale - 1, opt.audio_modality_scale - 1)
            x0_g += scales * (x0 - (latents - isolated * sigma))
        v_g, a_g = lay.split(x0_g)
        v_c, a_c = lay.split(x0)
        x0_g = Layout.join(rescale(v_g, v_c, opt.guidance_rescale),
                           rescale(a_g, a_c, opt.audio_guidance_rescale))
        return self.fixed(lay, (latents - x0_g) / sigma)

    def final_latents(self, request: DiffusionRequest) -> Tensor:
        """The two-stage recipe's upsample and refine steps (`two_stage`), or the base
        loop's latents."""
        return refine(self, request) if self.two_stage(request.params) else request.latents

    def two_stage(self, params: DiffusionParams) -> bool:
        """This request's recipe: its `upsample`, else the stage's option."""
        return self.options.upsample if params.upsample is None else params.upsample

    def fixed(self, lay: Layout, velocity: Tensor) -> Tensor:
        """The velocity the solver steps with (image-to-video: 0 on the first frame, which
        diffusers leaves out of its step)."""
        return velocity

    @staticmethod
    def _scales(lay: Layout, video: float, audio: float) -> Tensor:
        """(S,) the video's factor on its features, the audio's on its."""
        return torch.cat([torch.full((lay.video_size,), video),
                          torch.full((lay.audio_frames * lay.audio_channels,), audio)])

    def denoisers(self) -> list[torch.nn.Module]:
        return [self.transformer]

    # ---- decode ----------------------------------------------------------------------------

    def decode(self, latents: Tensor, params: DiffusionParams) -> Payload:   # type: ignore[override]
        """-> Payload(video uint8 (n, F, H, W, 3) at fps, audio float32 (n, ch, samples))."""
        lay = self.layout(params, final=True)
        video, audio = lay.split(latents.to(self.device, torch.float32))
        n = video.shape[0]
        z = self.vae.denormalize(video.transpose(1, 2).reshape(n, lay.channels, *lay.grid))
        timestep = (torch.zeros(n, device=self.device)
                    if self.vae.cfg.timestep_conditioning else None)
        frames = (self.vae.decode(z, timestep) / 2 + 0.5).clamp(0, 1)           # (n, 3, F, H, W)
        frames = (frames * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()
        mel = self.audio_vae.decode(self.audio_vae.unpack(self.audio_vae.denormalize(audio)))
        wave = self.vocoder(mel).float().cpu()
        return Payload(video=Video(frames, lay.fps),
                       audio=AudioChunk(wave, self.vocoder.sample_rate))
