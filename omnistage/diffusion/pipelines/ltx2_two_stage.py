"""LTX-2's distilled schedule and its two-stage recipe (base -> latent upsample -> refine), as
diffusers documents them for `LTX2Pipeline` with `LTX2LatentUpsamplePipeline` (its LTX-2 page,
"Distilled checkpoint generation"), used by ltx2.py when the stage's options ask:

    schedule: distilled   the distilled checkpoints' 8 sigmas, as they are (no dynamic or
                          terminal shift: the scheduler swap diffusers' page makes for its
                          stage 2, use_dynamic_shifting=False, shift_terminal=None; its
                          distilled example keeps the folder's scheduler, the same where that
                          has no dynamic shift), instead of linspace(1, 1/N, N)
                          shifted by mu, whatever num_inference_steps asks (named ignored);
                          the video's guidance 1 unless the request sets one
    upsample: true        the base loop runs at the asked size / the upsampler's factor; then,
                          per request, when its last step is done (`final_latents`):
        video latents denormalized -> the folder's latent_upsampler/ (raw VAE latents, no
        AdaIN, no tone map) -> normalized again; audio latents as they are
        both re-noised at the first refine sigma from the request's generator, video then
        audio: x = s0 * noise + (1 - s0) * x
        3 refine steps on sigmas (0.909375, 0.725, 0.421875) as they are, at the full size,
        video guidance 1 (the stage's other scales as in the base loop)
      and the full-size latents are decoded.

The refine steps run inside the request's decode, not batched with other requests' steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor

from omnistage.diffusion.request import DiffusionRequest
from omnistage.diffusion.solvers.flow_match_euler import FlowMatchEulerConfig, make_sigmas, step
from omnistage.models.ltx2_latent_upsampler import LTX2LatentUpsampler

# Lightricks' distilled schedules (ltx-pipelines' constants; diffusers' ltx2/utils.py)
DISTILLED_SIGMAS = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875)
REFINE_SIGMAS = (0.909375, 0.725, 0.421875)
SCHEDULES = ("default", "distilled")
UPSAMPLER = "latent_upsampler"


def as_is(cfg: FlowMatchEulerConfig) -> FlowMatchEulerConfig:
    """The folder's scheduler with its dynamic and terminal shifts off: given sigmas run as
    they are (its static `shift`, 1 for LTX-2, still applies, as in diffusers)."""
    return dataclasses.replace(cfg, use_dynamic_shifting=False, shift_terminal=None)


def distilled_sigmas(cfg: FlowMatchEulerConfig) -> Tensor:
    return make_sigmas(as_is(cfg), len(DISTILLED_SIGMAS), None, list(DISTILLED_SIGMAS))[0]


def load_upsampler(path: str | Path, device: torch.device) -> LTX2LatentUpsampler | None:
    """The folder's latent_upsampler/ (float32), or None when it has none."""
    folder = Path(path) / UPSAMPLER
    if not (folder / "config.json").is_file():
        return None
    upsampler = LTX2LatentUpsampler.from_pretrained(folder, device, torch.float32)
    if upsampler.cfg.temporal_upsample:
        raise ValueError(f"{folder}: a temporal upsampler (temporal_upsample) is not run; "
                         "the two-stage recipe takes a spatial one")
    return upsampler


def check_upsample(upsampler: LTX2LatentUpsampler | None, cfg_ranks: int) -> None:
    """What `diffusion.options.upsample: true` needs: a latent_upsampler/ and one CFG rank."""
    if upsampler is None:
        raise ValueError(f"diffusion.options.upsample: the folder has no {UPSAMPLER}/ "
                         "(diffusers' LTX2LatentUpsamplerModel)")
    if cfg_ranks > 1:
        raise ValueError("diffusion.options.upsample: the refine steps run on one rank "
                         "(no CFG-parallel)")


def base_side(side: int, factor: float, multiple: int) -> int:
    """The base loop's side for an asked `side`; ValueError when it is not a whole multiple
    of `multiple`."""
    base = side / factor
    if base != int(base) or int(base) % multiple:
        raise ValueError(f"{side}: with the latent upsampler (x{factor:g}) it must be "
                         f"{factor:g} x a multiple of {multiple}")
    return int(base)


def refine(pipe, request: DiffusionRequest) -> Tensor:
    """A finished base request's latents -> the refined full-size latents (see the module
    doc). `pipe` is the LTX2Pipeline."""
    params, generator = request.params, request.generator
    base, full = pipe.layout(params), pipe.layout(params, final=True)
    video, audio = base.split(request.latents.to(pipe.device, torch.float32))
    n = video.shape[0]
    raw = pipe.vae.denormalize(video.transpose(1, 2).reshape(n, base.channels, *base.grid))
    raw = pipe.upsampler(raw)
    assert tuple(raw.shape[2:]) == full.grid, (tuple(raw.shape), full.grid)
    video = pipe.vae.normalize(raw).flatten(2).transpose(1, 2)               # (n, N, C)
    audio = pipe.audio_vae.normalize(pipe.audio_vae.denormalize(audio))      # as diffusers
    s0 = REFINE_SIGMAS[0]
    noised = []
    for x in (video, audio):
        noise = torch.randn(x.shape, generator=generator).to(x.device)
        noised.append(s0 * noise + (1 - s0) * x)
    x = type(base).join(*noised)
    sigmas, _ = make_sigmas(as_is(pipe.scheduler), len(REFINE_SIGMAS), None,
                            list(REFINE_SIGMAS))
    rparams = dataclasses.replace(params, guidance_scale=1.0, cache_threshold=None)
    cond = request.cond if pipe.guided(rparams) else \
        {k: v for k, v in request.cond.items() if not k.startswith("negative_")}
    req = DiffusionRequest(request.request_id, None, rparams, x, sigmas, cond, generator)
    for i in range(len(REFINE_SIGMAS)):
        v = pipe.velocity_at(full, x, sigmas[i].repeat(n).to(x.device), [req])
        x = step(v, x, sigmas.to(x.device), i).to(x.dtype)
    return x
