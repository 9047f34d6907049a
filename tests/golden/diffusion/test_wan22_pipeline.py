"""Wan2.2 through our engine against diffusers on tiny random folders (float32): the T2V-A14B
two-expert folder against `WanPipeline` (a schedule crossing the boundary, a scale per
expert), the TI2V folder against `WanPipeline` (text) and `WanImageToVideoPipeline` with
`expand_timesteps` (text + first image); each request alone equal to it batched with others
at other steps (A14B: on the other expert; TI2V: with and without an image), each folder's
VideoSpec, and the refusals."""

from __future__ import annotations

import dataclasses
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

from omnistage import registry
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.registry import load_component
from omnistage.testing.diffusion import recording_experts, run_alone, run_staggered
from omnistage.testing.tiny_wan import build_tiny_wan22_a14b, build_tiny_wan22_ti2v
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")

PROMPT = "a cat walking on the beach"
NEGATIVE = "blurry"
FRAMES = 5                      # 2 latent frames
A14B_SIZE = (32, 48)            # 8x VAE: 4 x 6 latents
TI2V_SIZE = (64, 96)            # 16x VAE: 4 x 6 latents, 2 x 3 tokens a frame


def load(path) -> object:
    return load_component("diffusion", "wan").from_pretrained(path, "wan", torch.device("cpu"),
                                                              torch.float32)


@pytest.fixture(scope="module")
def a14b(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("wan22_a14b")
    return path, build_tiny_wan22_a14b(path), load(path)


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("wan22_ti2v")
    return path, build_tiny_wan22_ti2v(path), load(path)


@pytest.fixture(scope="module")
def image() -> Image.Image:
    """A first frame of another size than the video's: the resize is part of the path."""
    pixels = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def params(size: tuple[int, int], guidance: float, guidance_2: float | None = None,
           seed: int = 0, steps: int = 4, image: Image.Image | None = None) -> DiffusionParams:
    return DiffusionParams(height=size[0], width=size[1], num_frames=FRAMES,
                           num_inference_steps=steps, guidance_scale=guidance,
                           guidance_scale_2=guidance_2, seed=seed,
                           negative_prompt=NEGATIVE if guidance > 1 else None,
                           image=None if image is None else png(image))


def reference(ref, p: DiffusionParams, output_type: str = "latent"):
    return golden.reference(ref, PROMPT, p, output_type)


def i2v_reference(ref, p: DiffusionParams, image: Image.Image) -> Tensor:
    """diffusers' image-to-video pipeline over the TI2V folder's components, given the
    prompts as `WanPipeline` encodes them (its own encoding needs ftfy, not installed)."""
    i2v = diffusers.WanImageToVideoPipeline(
        tokenizer=ref.tokenizer, text_encoder=ref.text_encoder, vae=ref.vae,
        scheduler=ref.scheduler, transformer=ref.transformer, expand_timesteps=True)
    embeds, negative_embeds = ref.encode_prompt(
        PROMPT, p.negative_prompt, do_classifier_free_guidance=p.guidance_scale > 1,
        max_sequence_length=512, device=ref.device)   # as its __call__ does
    return i2v(image=image, prompt_embeds=embeds, negative_prompt_embeds=negative_embeds,
               height=p.height, width=p.width, num_frames=p.num_frames,
               num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
               generator=torch.Generator().manual_seed(p.seed), output_type="latent",
               return_dict=False)[0]


# ---- T2V-A14B: two experts ----------------------------------------------------------------

@pytest.mark.parametrize("guidance, guidance_2", [(6.0, 2.0), (3.0, None)],
                         ids=["two-scales", "one-scale"])
def test_a14b_matches_diffusers(a14b, guidance: float, guidance_2: float | None) -> None:
    _, ref, ours = a14b
    assert ours.solver.make_sigmas(4)[1].tolist() == [999, 900, 750, 500]   # boundary 875
    p = params(A14B_SIZE, guidance, guidance_2)
    latents, _ = run_alone(ours, PROMPT, p)
    expected = reference(ref, p)
    golden.assert_latents_match(latents, expected, min_abs_mean=0.1)
    if guidance_2 is not None:     # the scales swapped give another video: the test sees it
        swapped = reference(ref, dataclasses.replace(p, guidance_scale=guidance_2,
                                                     guidance_scale_2=guidance))
        assert (swapped - expected).abs().max() > 1e-3    # 10x the tolerance


def test_a14b_boundary_timestep_is_the_high_noise_experts(a14b) -> None:
    """diffusers: `t >= boundary_ratio * num_train_timesteps` (875 here) runs `transformer`."""
    _, _, ours = a14b
    at = [SimpleNamespace(cond={"timesteps": torch.tensor([t])}, step_idx=0,
                          params=DiffusionParams()) for t in (999, 875, 874)]
    assert [ours.expert(r) for r in at] == [0, 0, 1]
    for r in at:                        # a request's own boundary_ratio: 0.9 -> 900
        r.params = DiffusionParams(boundary_ratio=0.9)
    assert [ours.expert(r) for r in at] == [0, 1, 1]


def test_a14b_schedule_per_request_matches_diffusers_configured_so(a14b) -> None:
    """vLLM-Omni's `boundary_ratio` and `flow_shift` per request: the latents of diffusers'
    WanPipeline built with that boundary and a scheduler with that shift; a batch mixing them
    with the checkpoint's schedule gives each its own; a one-expert model names the boundary
    unused."""
    _, ref, ours = a14b
    custom = dataclasses.replace(params(A14B_SIZE, 6.0, 2.0, steps=5), boundary_ratio=0.6,
                                 flow_shift=5.0)
    assert ours.solver.make_sigmas(5, 5.0)[1].tolist() != ours.solver.make_sigmas(5)[1].tolist()
    configured = diffusers.WanPipeline(
        tokenizer=ref.tokenizer, text_encoder=ref.text_encoder, vae=ref.vae,
        transformer=ref.transformer, transformer_2=ref.transformer_2, boundary_ratio=0.6,
        scheduler=diffusers.UniPCMultistepScheduler.from_config(ref.scheduler.config,
                                                                flow_shift=5.0))
    expected = reference(configured, custom)
    latents, _ = run_alone(ours, PROMPT, custom)
    golden.assert_latents_match(latents, expected, min_abs_mean=0.1)
    default = reference(ref, dataclasses.replace(custom, boundary_ratio=None, flow_shift=None))
    assert (default - expected).abs().max() > 1e-3          # the fields change the video
    jobs = {"own": (PROMPT, custom), "ckpt": (PROMPT, dataclasses.replace(
        custom, boundary_ratio=None, flow_shift=None, seed=1))}
    batched, _ = run_staggered(ours, jobs, lag=1)
    golden.assert_latents_match(batched["own"][0], expected, min_abs_mean=0.1)
    assert ours.unused_params(custom) == {}


def test_a14b_requests_on_different_experts_equal_each_alone(a14b) -> None:
    _, _, ours = a14b
    jobs = {"a": (PROMPT, params(A14B_SIZE, 4.0, 2.0, seed=1, steps=6)),
            "b": ("a dog", params(A14B_SIZE, 1.0, seed=2, steps=3)),
            "c": ("waves", params(A14B_SIZE, 3.0, 5.0, seed=3, steps=5))}
    with recording_experts(ours) as calls:
        batched, _ = run_staggered(ours, jobs, lag=2)
    assert [1, "a"] in calls and [0, "b"] in calls    # a on the low expert, b on the high
    for rid, (prompt, p) in jobs.items():
        latents, _ = run_alone(ours, prompt, p)
        assert (batched[rid][0] - latents).abs().max() < 1e-5, rid


# ---- TI2V-5B: text, or text + first image -------------------------------------------------

def test_ti2v_text_matches_diffusers(ti2v) -> None:
    _, ref, ours = ti2v
    p = params(TI2V_SIZE, 5.0)
    run = golden.matches_diffusers(ref, ours, PROMPT, p, image_atol=None, output="np",
                                   min_abs_mean=0.1)
    assert run.output.shape == (1, FRAMES, *TI2V_SIZE, 3)


def test_ti2v_image_matches_diffusers(ti2v, image: Image.Image) -> None:
    _, ref, ours = ti2v
    p = params(TI2V_SIZE, 4.0, image=image)
    latents, _ = run_alone(ours, PROMPT, p)
    expected = i2v_reference(ref, p, image)
    golden.assert_latents_match(latents, expected, min_abs_mean=0.1)
    text_only = reference(ref, dataclasses.replace(p, image=None))
    assert (expected[:, :, 0] - text_only[:, :, 0]).abs().max() > 0.1  # the image matters


def test_ti2v_with_and_without_image_at_different_steps_equal_each_alone(
        ti2v, image: Image.Image) -> None:
    _, _, ours = ti2v
    jobs = {"a": (PROMPT, params(TI2V_SIZE, 5.0, seed=1, image=image)),
            "b": ("a dog", params(TI2V_SIZE, 1.0, seed=2, steps=3)),
            "c": ("waves", params(TI2V_SIZE, 3.0, seed=3, image=image))}
    batched, engine = run_staggered(ours, jobs)
    assert engine.num_steps_run == 6                  # c joined at a's step 2: 2 + 4
    for rid, (prompt, p) in jobs.items():
        latents, _ = run_alone(ours, prompt, p)
        assert (batched[rid][0] - latents).abs().max() < 1e-5, rid


# ---- what each folder allows ----------------------------------------------------------------

def test_video_specs_read_from_the_folders(a14b, ti2v) -> None:
    for (path, _, ours), multiple, fps, frames, i2v in ((a14b, 16, 16, 81, False),
                                                        (ti2v, 32, 24, 121, True)):
        spec = registry.video_spec(path)
        assert registry.match_folder(path).name == "wan"
        assert (spec.size_multiple, spec.fps, spec.default_num_frames, spec.image_to_video) \
            == (multiple, fps, frames, i2v)
        assert ours.video == spec


@pytest.mark.parametrize("folder, field, value, match", [
    ("a14b", "num_frames", 6, "1 \\+ a multiple of 4"),
    ("a14b", "image", "png", "text only"),
    ("ti2v", "height", 48, "multiple of 32"),
    ("ti2v", "num_frames", 8, "1 \\+ a multiple of 4"),
    ("ti2v", "guidance_scale_2", 2.0, "one transformer")])
def test_refusals(request: pytest.FixtureRequest, image: Image.Image, folder: str, field: str,
                  value: object, match: str) -> None:
    _, _, ours = request.getfixturevalue(folder)
    size = A14B_SIZE if folder == "a14b" else TI2V_SIZE
    p = dataclasses.replace(params(size, 1.0), **{field: png(image) if value == "png" else value})
    with pytest.raises(ValueError, match=match):
        DiffusionEngine(ours).add_request("x", PROMPT, p)


def test_ti2v_with_an_image_served_by_omni_with_its_default_graph(ti2v, image: Image.Image
                                                                   ) -> None:
    """The image file travels to the stage beside its params (ImageRef) and back."""
    from omnistage import Omni

    path, _, ours = ti2v
    p = params(TI2V_SIZE, 1.0, steps=2, image=image)
    expected, _ = run_alone(ours, PROMPT, p)
    with Omni(str(path), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate([PROMPT], [p])
    video = out.tensors["video"]
    assert video.shape == (1, FRAMES, *TI2V_SIZE, 3) and video.dtype == torch.uint8
    assert torch.equal(video, ours.decode(expected, p))


def test_video_api_fields_reach_the_pipeline(a14b, ti2v, image: Image.Image) -> None:
    """/v1/videos' checks (`plan`) against each folder's spec: guidance_scale_2 through to
    A14B's params, the first image accepted by TI2V only; defaults the pipeline takes."""
    from omnistage.entrypoints.openai.errors import APIError
    from omnistage.entrypoints.openai.protocol_video import VideoRequest
    from omnistage.entrypoints.openai.video_params import VideoLimits, plan

    req = VideoRequest(prompt=PROMPT, guidance_scale=4.0, guidance_scale_2=3.0)
    path, _, ours = a14b
    fields, size, _ = plan(registry.video_spec(path), VideoLimits(), req, None)
    assert fields["guidance_scale_2"] == 3.0 and size == "832x480"
    ours.validate(PROMPT, DiffusionParams(**fields))
    with pytest.raises(APIError, match="text only"):
        plan(registry.video_spec(path), VideoLimits(), req, png(image))
    path, _, ours = ti2v
    fields, size, _ = plan(registry.video_spec(path), VideoLimits(),
                           VideoRequest(prompt=PROMPT), png(image))
    assert size == "1280x704" and fields["num_frames"] == 121 and fields["fps"] == 24
    ours.validate(PROMPT, DiffusionParams(**fields, image=png(image)))


def test_a_one_expert_model_names_the_boundary_unused(ti2v) -> None:
    _, _, ours = ti2v
    p = DiffusionParams(boundary_ratio=0.5, flow_shift=4.0)
    assert list(ours.unused_params(p)) == ["boundary_ratio"]     # flow_shift: used
