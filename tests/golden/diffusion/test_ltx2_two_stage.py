"""LTX-2's distilled schedule and two-stage recipe (omnistage/diffusion/pipelines/
ltx2_two_stage.py) against diffusers as its LTX-2 page runs a distilled folder: `LTX2Pipeline`
with `sigmas=DISTILLED_SIGMA_VALUES` (the scheduler's shifts off), `LTX2LatentUpsamplePipeline`
on its latents, then `LTX2Pipeline` again on the upsampled latents and the audio latents,
re-noised at `STAGE_2_DISTILLED_SIGMA_VALUES[0]` and refined on those sigmas, one generator
throughout. Tiny random folder (tests/helpers/ltx2.py) with a tiny `latent_upsampler/`,
float32; the final video and audio latents within 1e-4."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.ltx2 import LTX2Options
from omnistage.registry import load_component
from tests.helpers.ltx2 import add_tiny_upsampler, build_tiny_ltx2
from tests.helpers.ltx2_run import conditioning, final_latents, run_ours
from tests.helpers.ltx2_text import add_tiny_text_encoder

pytest.importorskip("diffusers")

H, W, FRAMES = 64, 128, 5           # two-stage: the asked size; the base loop runs at 32 x 64
NO_EXTRAS = LTX2Options(audio_guidance_scale=1.0, modality_scale=1.0, audio_modality_scale=1.0,
                        guidance_rescale=0.0, audio_guidance_rescale=0.0)
DISTILLED = dataclasses.replace(NO_EXTRAS, schedule="distilled")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    """(path with a latent_upsampler/, path without one, diffusers' pipeline, its upsampler)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    bare = tmp_path_factory.mktemp("ltx2")
    ref = build_tiny_ltx2(bare)
    path = tmp_path_factory.mktemp("ltx2_up")
    ref.save_pretrained(path)
    upsampler = add_tiny_upsampler(path)
    add_tiny_text_encoder(path)
    # diffusers' documented swap: the given sigmas run as they are
    ref.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        ref.scheduler.config, use_dynamic_shifting=False, shift_terminal=None)
    return path, bare, ref, upsampler


def load(path) -> object:
    return load_component("diffusion", "ltx2").from_pretrained(
        path, "ltx2", torch.device("cpu"), torch.float32, text_encoders=False)


def params(guidance: float | None, seed: int, **kw) -> DiffusionParams:
    return DiffusionParams(**{**dict(height=H, width=W, num_frames=FRAMES, fps=24.0,
                                     num_inference_steps=8), **kw},
                           guidance_scale=guidance, seed=seed)


def call(ref, text: dict, opt: LTX2Options, generator, **kw):
    return ref(**text, num_frames=FRAMES, frame_rate=24.0, guidance_scale=kw.pop("g"),
               audio_guidance_scale=opt.audio_guidance_scale, modality_scale=opt.modality_scale,
               audio_modality_scale=opt.audio_modality_scale,
               guidance_rescale=opt.guidance_rescale,
               audio_guidance_rescale=opt.audio_guidance_rescale, stg_scale=0.0,
               audio_stg_scale=0.0, generator=generator, output_type="latent",
               return_dict=False, **kw)


def two_stage_reference(ref, upsampler, text: dict, opt: LTX2Options, p: DiffusionParams,
                        guidance: float):
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES as BASE
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES as REFINE

    g = torch.Generator().manual_seed(p.seed)
    video, audio = call(ref, text, opt, g, g=guidance, height=H // 2, width=W // 2,
                        num_inference_steps=len(BASE), sigmas=BASE)
    up = LTX2LatentUpsamplePipeline(vae=ref.vae, latent_upsampler=upsampler)
    up.set_progress_bar_config(disable=True)
    video = up(latents=video, output_type="latent", return_dict=False)[0]
    return call(ref, text, opt, g, g=1.0, latents=video, audio_latents=audio,
                num_inference_steps=len(REFINE), noise_scale=REFINE[0], sigmas=REFINE)


def check(got: torch.Tensor, ours, p: DiffusionParams, video, audio) -> None:
    got_video, got_audio = final_latents(ours, p, got)
    for g, e in ((got_video, video), (got_audio, audio)):
        assert g.shape == e.shape, (g.shape, e.shape)
        assert e.abs().mean() > 0.3, float(e.abs().mean())
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("guidance", [None, 4.0])
def test_distilled_schedule_matches_diffusers(folder, guidance) -> None:
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    path, _, ref, _ = folder
    ours = load(path)
    ours.configure(DISTILLED)
    p = params(guidance, seed=1, num_images=2, height=H // 2, width=W // 2)
    text, cond = conditioning(ref, seed=1)
    text = {k: v.repeat(2, 1, *([1] * (v.dim() - 2))) for k, v in text.items()}
    video, audio = call(ref, text, DISTILLED, torch.Generator().manual_seed(1),
                        g=guidance or 1.0, height=H // 2, width=W // 2,
                        num_inference_steps=8, sigmas=DISTILLED_SIGMA_VALUES)
    check(run_ours(ours, {"a": (p, cond)})["a"][0], ours, p, video, audio)


@pytest.mark.parametrize("case", ["distilled", "guided-base"])
def test_two_stage_matches_diffusers(folder, case: str) -> None:
    """Base (distilled sigmas) at half size -> latent upsampler -> 3 refine steps; the second
    case two videos, with the stage's audio CFG, modality guidance and rescale on, in both
    loops, and video CFG in the base one."""
    path, _, ref, upsampler = folder
    opt = dataclasses.replace(DISTILLED if case == "distilled" else
                              LTX2Options(schedule="distilled"), upsample=True)
    guidance, n = (1.0, 1) if case == "distilled" else (3.0, 2)
    ours = load(path)
    ours.configure(opt)
    p = params(guidance, seed=2, num_images=n)
    text, cond = conditioning(ref, seed=2)
    text = {k: v.repeat(n, 1, *([1] * (v.dim() - 2))) for k, v in text.items()}
    video, audio = two_stage_reference(ref, upsampler, text, opt, p, guidance)
    got = run_ours(ours, {"a": (p, cond)})["a"][0]
    assert got.shape == (n, ours.layout(p, final=True).video_size + audio[0].numel())
    check(got, ours, p, video, audio)


def test_upsample_refused_without_an_upsampler_and_odd_sizes(folder) -> None:
    path, bare, _, _ = folder
    with pytest.raises(ValueError, match="upsample.*latent_upsampler"):
        load(bare).configure(dataclasses.replace(DISTILLED, upsample=True))
    ours = load(path)
    ours.configure(dataclasses.replace(DISTILLED, upsample=True))
    with pytest.raises(ValueError, match="width=96"):
        DiffusionEngine(ours).add_request("x", None, params(1.0, 0, width=96))


def test_distilled_names_other_step_counts_ignored(folder) -> None:
    path, _, _, _ = folder
    ours = load(path)
    ours.configure(DISTILLED)
    assert set(ours.unused_params(params(None, 0, num_inference_steps=20))) == \
        {"num_inference_steps"}
    assert ours.unused_params(params(None, 0)) == {}


def test_served_with_the_two_stage_graph(folder) -> None:
    """`--stage-config ltx2_two_stage`: the asked size comes back, with its sound track."""
    from omnistage import Omni

    path, _, _, _ = folder
    with Omni(str(path), stage_config="ltx2_two_stage", device="cpu", backend="inproc",
              connector="inproc") as omni:
        (out,) = omni.generate(["a dog barks"], [params(None, seed=3)])
    assert out.error is None, out.error
    video, audio = out.tensors["video"], out.tensors["audio"]
    assert video.shape == (1, FRAMES, H, W, 3) and video.dtype == torch.uint8
    assert audio.dim() == 3 and audio.shape[:2] == (1, 2) and audio.abs().mean() > 0.01


def test_image_to_video_distilled_matches_diffusers(folder) -> None:
    """`schedule: distilled` on `ltx2_i2v`: LTX2ImageToVideoPipeline with the distilled
    sigmas, the first frame the image's."""
    import io

    from diffusers import LTX2ImageToVideoPipeline
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES
    from PIL import Image

    from omnistage.diffusion.pipelines.ltx2_i2v import LTX2I2VOptions
    from omnistage.testing.diffusion import png

    path, _, ref, _ = folder
    i2v = LTX2ImageToVideoPipeline(**ref.components)
    i2v.set_progress_bar_config(disable=True)
    ours = load_component("diffusion", "ltx2_i2v").from_pretrained(
        path, "ltx2_i2v", torch.device("cpu"), torch.float32, text_encoders=False)
    opt = LTX2I2VOptions(**{f.name: getattr(DISTILLED, f.name)
                            for f in dataclasses.fields(DISTILLED)}, image_crf=0)
    ours.configure(opt)
    image = png(W // 2 + 5, H // 2 + 3, seed=6)
    p = params(None, seed=7, height=H // 2, width=W // 2, image=image)
    text, cond = conditioning(ref, seed=7)
    video, audio = call(i2v, dict(text, image=Image.open(io.BytesIO(image)), image_crf=0),
                        opt, torch.Generator().manual_seed(7), g=1.0, height=H // 2,
                        width=W // 2, num_inference_steps=8, sigmas=DISTILLED_SIGMA_VALUES)
    check(run_ours(ours, {"a": (p, cond)})["a"][0], ours, p, video, audio)


def test_two_stage_requests_batched_equal_each_alone(folder) -> None:
    """Two-stage requests of other seeds, frame counts and steps through one engine (their
    base steps batched, their refines in their decodes) equal each run alone."""
    path, _, ref, _ = folder
    ours = load(path)
    ours.configure(dataclasses.replace(DISTILLED, upsample=True))
    jobs = {"a": (params(1.0, seed=5), conditioning(ref, 5)[1]),
            "b": (params(1.0, seed=6, num_frames=9), conditioning(ref, 6)[1]),
            "c": (params(1.0, seed=7), conditioning(ref, 7)[1])}
    batched = run_ours(ours, jobs, lag=2)
    for rid, job in jobs.items():
        alone = run_ours(ours, {rid: job})[rid]
        assert (batched[rid][0] - alone[0]).abs().max() < 1e-5, rid


@pytest.mark.parametrize("name, upsample", [("ltx2_distilled", False), ("ltx2_two_stage", True)])
def test_shipped_graphs_read_as_the_distilled_recipe(name: str, upsample: bool) -> None:
    from omnistage.configs.defaults import stage_config_text
    from omnistage.configs.graph import load_graph
    from omnistage.diffusion.pipelines.ltx2 import LTX2Pipeline
    from omnistage.stages.diffusion_component import check_options

    (stage,) = load_graph(stage_config_text(name)).stages
    opt = check_options(stage, LTX2Pipeline)
    assert opt == dataclasses.replace(DISTILLED, stg_blocks=LTX2Options().stg_blocks,
                                      stg_scale=0.0, audio_stg_scale=0.0, upsample=upsample)
