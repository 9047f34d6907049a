"""LTX-2 text-to-video (and image-to-video) with sound through our engine against diffusers' `LTX2Pipeline` on a
tiny random folder (float32, tests/helpers/ltx2.py): the same final video and audio latents
(denormalized, as `output_type="latent"` returns them), frames within 2/255 and the waveform
within 1e-4, with and without guidance, with modality guidance and rescale; requests at other
steps and sizes batched together equal each alone; bad frame counts and sizes refused.

The prompt side is diffusers' own: the test gives both pipelines the same Gemma-like hidden
states (diffusers' `prompt_embeds`), and ours gets what diffusers' connectors make of them, as
the text stage hands it over (`set_conditioning`)."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.ltx2 import LTX2Options
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.payloads import Payload
from omnistage.registry import load_component
from omnistage.testing.diffusion import run_alone
from tests.helpers.ltx2 import build_tiny_ltx2
from tests.helpers.ltx2_run import conditioning, final_latents, run_ours
from tests.helpers.ltx2_text import add_tiny_text_encoder

pytest.importorskip("diffusers")

H, W, FRAMES = 32, 64, 5            # 8x VAE, 2x in time: 4 x 8 latents, 3 latent frames
NO_EXTRAS = LTX2Options(audio_guidance_scale=1.0, modality_scale=1.0, audio_modality_scale=1.0,
                        guidance_rescale=0.0, audio_guidance_rescale=0.0)


PROMPT, NEGATIVE = "a dog barks at the sea", "silence"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    """The tiny LTX-2 folder with a Gemma 3 and tokenizer (tests/helpers/ltx2_text.py) ->
    (path, diffusers' pipeline without them: the tests give it prompt embeddings)."""
    path = tmp_path_factory.mktemp("ltx2")
    ref = build_tiny_ltx2(path)
    add_tiny_text_encoder(path)
    return path, ref


@pytest.fixture(scope="module")
def pair(folder):
    path, ref = folder
    return ref, load_component("diffusion", "ltx2").from_pretrained(
        path, "ltx2", torch.device("cpu"), torch.float32)


def params(guidance: float, seed: int = 0, steps: int = 3, **kw) -> DiffusionParams:
    return DiffusionParams(**{**dict(height=H, width=W, num_frames=FRAMES, fps=24.0), **kw},
                           num_inference_steps=steps, guidance_scale=guidance, seed=seed)


def reference(ref, p: DiffusionParams, opt: LTX2Options, text: dict, output_type: str):
    """diffusers' call for our params; n videos of one prompt as n rows of its embeddings
    (given embeddings are not repeated by num_videos_per_prompt), one generator."""
    text = {k: v.repeat(p.num_images, 1, *([1] * (v.dim() - 2))) if torch.is_tensor(v) else v
            for k, v in text.items()}
    return ref(**text, height=p.height, width=p.width, num_frames=p.num_frames,
               frame_rate=p.fps, num_inference_steps=p.num_inference_steps,
               guidance_scale=p.guidance_scale, audio_guidance_scale=opt.audio_guidance_scale,
               modality_scale=opt.modality_scale, audio_modality_scale=opt.audio_modality_scale,
               guidance_rescale=opt.guidance_rescale,
               audio_guidance_rescale=opt.audio_guidance_rescale, stg_scale=0.0,
               audio_stg_scale=0.0,
               generator=torch.Generator().manual_seed(p.seed), output_type=output_type,
               return_dict=False)


CASES = {"no-cfg": (1.0, NO_EXTRAS), "cfg": (4.0, dataclasses.replace(
    NO_EXTRAS, audio_guidance_scale=6.0)), "defaults": (3.0, LTX2Options())}


@pytest.mark.parametrize("case", list(CASES))
def test_latents_match_diffusers(pair, case: str) -> None:
    ref, ours = pair
    guidance, opt = CASES[case]
    ours.configure(opt)
    p = params(guidance, num_images=2 if case == "cfg" else 1)
    text, cond = conditioning(ref, seed=1)
    video, audio = reference(ref, p, opt, text, "latent")
    got = run_ours(ours, {"a": (p, cond)})["a"]
    got_video, got_audio = final_latents(ours, p, got[0])
    for g, e in ((got_video, video), (got_audio, audio)):
        assert g.shape == e.shape
        assert e.abs().mean() > 0.3, float(e.abs().mean())
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


def test_frames_and_waveform_match_diffusers_from_text(folder, pair) -> None:
    """End to end from the prompt: Gemma 3 and connectors (LTX-C's), the loop, the video VAE,
    the audio VAE and the vocoder (LTX-B's) against diffusers' whole call."""
    from diffusers import LTX2Pipeline as Reference

    path, _ = folder
    _, ours = pair
    ours.configure(LTX2Options())
    ref = Reference.from_pretrained(path).to(torch.float32)
    ref.set_progress_bar_config(disable=True)
    p = params(3.0, seed=5, negative_prompt=NEGATIVE)
    video, audio = ref(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W,
                       num_frames=FRAMES, frame_rate=p.fps, num_inference_steps=3,
                       guidance_scale=3.0, stg_scale=0.0, audio_stg_scale=0.0,
                       generator=torch.Generator().manual_seed(5), output_type="np",
                       return_dict=False)
    _, out = run_alone(ours, PROMPT, p)
    assert isinstance(out, Payload)
    frames = out.video.frames
    assert frames.shape == (1, FRAMES, H, W, 3) and frames.dtype == torch.uint8
    assert 0.1 < video.mean() < 0.9 and video.std() > 0.05, (video.mean(), video.std())
    assert np.abs(frames.numpy() / 255.0 - video).max() <= 2 / 255
    wave = out.audio.samples
    assert out.audio.sample_rate == ref.vocoder.config.output_sampling_rate
    assert wave.shape == audio.shape and audio.abs().mean() > 0.05, float(audio.abs().mean())
    torch.testing.assert_close(wave, audio.float(), atol=1e-4, rtol=0)


def test_requests_at_different_steps_and_sizes_equal_each_alone(pair) -> None:
    ref, ours = pair
    ours.configure(LTX2Options())
    jobs = {"a": (params(3.0, seed=1, steps=4), conditioning(ref, 1)[1]),
            "b": (params(1.0, seed=2, steps=3, height=64, width=32, fps=25.0),
                  conditioning(ref, 2)[1]),
            "c": (params(5.0, seed=3, steps=3, num_frames=9), conditioning(ref, 3)[1])}
    batched = run_ours(ours, jobs, lag=1)
    for rid, job in jobs.items():
        alone = run_ours(ours, {rid: job})[rid]
        assert (batched[rid][0] - alone[0]).abs().max() < 1e-5, rid


@pytest.mark.parametrize("field, value, match", [
    ("num_frames", 6, "1 \\+ a multiple of"), ("height", 48, "height"), ("width", 40, "width")])
def test_refuses_bad_shapes(pair, field: str, value: int, match: str) -> None:
    _, ours = pair
    p = dataclasses.replace(params(1.0), **{field: value})
    with pytest.raises(ValueError, match=match):
        DiffusionEngine(ours).add_request("x", PROMPT, p)


def test_served_by_omni_with_its_default_graph(folder) -> None:
    """The folder picked up by its model_index.json (the ltx2 row, ltx2.yaml): the stage's
    final output carries the frames and the sound track."""
    from omnistage import Omni

    path, _ = folder
    with Omni(str(path), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate([PROMPT], [params(3.0, steps=2)])
    assert out.error is None, out.error
    video, audio = out.tensors["video"], out.tensors["audio"]
    assert video.shape == (1, FRAMES, H, W, 3) and video.dtype == torch.uint8
    assert audio.dim() == 3 and audio.shape[:2] == (1, 2) and audio.abs().mean() > 0.01


@pytest.mark.parametrize("crf", [33, 0])
def test_image_to_video_latents_match_diffusers(folder, crf: int) -> None:
    """LTX2ImageToVideoPipeline: the first latent frame the image's (re-compressed at crf as
    diffusers does, its default 33, or not), its tokens at timestep 0, left out of the step."""
    from diffusers import LTX2ImageToVideoPipeline as Reference

    from omnistage.diffusion.pipelines.ltx2_i2v import LTX2I2VOptions
    from omnistage.testing.diffusion import png

    path, t2v = folder
    ref = Reference(**t2v.components)
    ref.set_progress_bar_config(disable=True)
    ours = load_component("diffusion", "ltx2_i2v").from_pretrained(
        path, "ltx2_i2v", torch.device("cpu"), torch.float32)
    opt = LTX2I2VOptions(image_crf=crf)
    ours.configure(opt)
    image = png(W + 6, H + 3, seed=4)                  # resized to the video's size
    p = params(3.0, seed=2, image=image)
    text, cond = conditioning(t2v, seed=3)
    video, audio = reference(ref, p, opt, dict(text, image=Image.open(io.BytesIO(image)),
                                               image_crf=crf), "latent")
    got = run_ours(ours, {"a": (p, cond)})["a"]
    got_video, got_audio = final_latents(ours, p, got[0])
    for g, e in ((got_video, video), (got_audio, audio)):
        assert g.shape == e.shape
        assert e.abs().mean() > 0.3, float(e.abs().mean())
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


def test_image_to_video_needs_an_image(pair, folder) -> None:
    path, _ = folder
    ours = load_component("diffusion", "ltx2_i2v").from_pretrained(
        path, "ltx2_i2v", torch.device("cpu"), torch.float32, text_encoders=False)
    with pytest.raises(ValueError, match="image"):
        DiffusionEngine(ours).add_request("x", None, params(1.0))


def test_step_cache_skips_steps_and_threshold_zero_changes_nothing(pair) -> None:
    """Step caching (the request's cache_threshold) over both streams at once, a state per
    branch (cond, uncond, the modality pass): threshold 0 never skips and equals no caching;
    a large one skips steps between the first and the last and stays near it."""
    from omnistage.testing.diffusion import run_to_end

    ref, ours = pair
    ours.configure(LTX2Options())
    cond = conditioning(ref, 4)[1]

    def run(threshold: float | None) -> tuple[torch.Tensor, int]:
        p = params(3.0, seed=6, steps=6, cache_threshold=threshold)
        latents = run_ours(ours, {"a": (p, cond)})["a"][0]
        engine = DiffusionEngine(ours)
        engine.add_request("a", None, p)
        engine.set_conditioning("a", cond)
        return latents, run_to_end(engine)["a"].metrics.num_steps_skipped

    plain, _ = run(None)
    zero, skipped_zero = run(0.0)
    loose, skipped = run(50.0)
    assert skipped_zero == 0 and (zero - plain).abs().max() < 1e-5
    assert 0 < skipped <= 4, skipped
    assert torch.isfinite(loose).all() and not torch.equal(loose, plain)


def test_names_the_fields_it_ignores(pair) -> None:
    _, ours = pair
    ours.configure(NO_EXTRAS)
    p = params(1.0, negative_prompt="x", guidance_scale_2=2.0, true_cfg_scale=4.0)
    assert set(ours.unused_params(p)) == {"negative_prompt", "guidance_scale_2",
                                          "true_cfg_scale"}
    assert ours.unused_params(params(3.0, negative_prompt="x")) == {}
