"""Golden: our HunyuanVideo-1.5 text-to-video pipeline (engine, flow-match Euler, CFG as
diffusers' guider computes it) against diffusers' `HunyuanVideo15Pipeline` on the same tiny
random folder, float32: final latents (`output_type="latent"`) for the same conditioning
(a fake prompt encoder gives both sides the same Qwen / byT5 states; diffusers gets them as
prompt_embeds), seeds and sizes; two videos per prompt at an odd latent grid (3 x 5 x 7);
requests batched at different steps; the guider's window and rescale; bad input refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.diffusion_params import DiffusionParams
from omnistage.errors import InputError
from omnistage.testing.diffusion import run_alone, run_staggered
from tests.helpers.diffusion_golden import assert_latents_match
from tests.helpers.hunyuan_video15 import FakePromptEncoder, build_tiny_t2v

pytest.importorskip("diffusers")

PROMPT = 'a cat holds a sign that says "hi"'


def _ours(path: Path):
    pipe = load_ours_without_text(path)
    pipe.prompt_encoder = FakePromptEncoder()
    return pipe


def load_ours_without_text(path: Path):
    from omnistage.diffusion.pipelines.hunyuan_video15 import HunyuanVideo15Pipeline

    return HunyuanVideo15Pipeline.from_pretrained(path, "hunyuan_video15", torch.device("cpu"),
                                                  torch.float32, text_encoders=False)


def _reference(ref, prompt: str, params: DiffusionParams) -> torch.Tensor:
    fake = FakePromptEncoder()
    kw = fake.padded(prompt) | fake.padded(params.negative_prompt or "", "negative_")
    # n videos of one prompt as n rows of its states (diffusers' num_videos_per_prompt > 1
    # makes its all-zero image embeds one row short: a shape error in its transformer)
    kw = {k: v.repeat(params.num_images, *[1] * (v.dim() - 1)) for k, v in kw.items()}
    with torch.no_grad():
        return ref(height=params.height, width=params.width, num_frames=params.num_frames,
                   num_inference_steps=params.num_inference_steps,
                   generator=torch.Generator().manual_seed(params.seed), output_type="latent",
                   return_dict=False, **kw)[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("hv15")
    return path, build_tiny_t2v(path)


def test_latents_match_diffusers(folder: tuple[Path, object]) -> None:
    path, ref = folder
    params = DiffusionParams(height=40, width=56, num_frames=9, num_inference_steps=3, seed=7,
                             num_images=2, negative_prompt="blurry")
    got, _ = run_alone(_ours(path), PROMPT, params)
    expected = _reference(ref, PROMPT, params)
    assert_latents_match(got, expected, shape=(2, 4, 3, 5, 7))


def test_batched_at_different_steps_match_each_alone(folder: tuple[Path, object]) -> None:
    """Two requests (their own captions, glyph text or none, seeds) one step apart share
    the transformer's batch: each ends as diffusers' run of it alone."""
    path, ref = folder
    jobs = {"a": (PROMPT, DiffusionParams(height=40, width=56, num_frames=5,
                                          num_inference_steps=3, seed=1)),
            "b": ("a dog runs on the beach", DiffusionParams(
                height=40, width=56, num_frames=5, num_inference_steps=4, seed=2,
                negative_prompt="low quality"))}
    results, _ = run_staggered(_ours(path), jobs)
    for rid, (prompt, params) in jobs.items():
        assert_latents_match(results[rid][0], _reference(ref, prompt, params))


def test_guider_window_and_rescale_match_diffusers(tmp_path: Path) -> None:
    ref = build_tiny_t2v(tmp_path, guidance_scale=3.0, guidance_rescale=0.4, stop=0.6)
    params = DiffusionParams(height=24, width=40, num_frames=5, num_inference_steps=4, seed=3)
    got, _ = run_alone(_ours(tmp_path), PROMPT, params)
    assert_latents_match(got, _reference(ref, PROMPT, params))


@pytest.mark.parametrize("field, params", [
    ("num_frames", DiffusionParams(num_frames=8)),
    ("height", DiffusionParams(height=36, width=56)),
    ("width", DiffusionParams(height=40, width=60)),
    ("image", DiffusionParams(image=b"\x89PNG not really")),
])
def test_bad_input_names_the_field(folder: tuple[Path, object], field: str,
                                   params: DiffusionParams) -> None:
    with pytest.raises(InputError) as err:
        _ours(folder[0]).validate(PROMPT, params)
    assert err.value.param == field and field in str(err.value)


def test_frames_end_to_end_match_diffusers(tmp_path: Path) -> None:
    """Prompt to frames: our Qwen2.5-VL + byT5 encoding, denoising and VAE decode against
    diffusers' whole pipeline on the same tiny folder: uint8 frames within 2/255."""
    from tests.helpers.diffusion_golden import assert_output_matches

    ref = build_tiny_t2v(tmp_path, text=True)
    ours = load_ours_without_text(tmp_path)
    from omnistage.diffusion.pipelines.hunyuan_video15_text import PromptEncoder

    ours.prompt_encoder = PromptEncoder.from_pretrained(tmp_path, torch.device("cpu"),
                                                        torch.float32, ours.guider.guides)
    params = DiffusionParams(height=24, width=40, num_frames=5, num_inference_steps=2, seed=5,
                             negative_prompt="dark")
    latents, frames = run_alone(ours, PROMPT, params)
    with torch.no_grad():
        kw = dict(prompt=PROMPT, negative_prompt="dark", height=24, width=40, num_frames=5,
                  num_inference_steps=2, return_dict=False)
        expected_latents = ref(generator=torch.Generator().manual_seed(5), output_type="latent",
                               **kw)[0]
        expected = ref(generator=torch.Generator().manual_seed(5), output_type="np", **kw)[0]
    assert_latents_match(latents, expected_latents, rtol=1e-4)   # real encoders: larger states
    assert_output_matches(frames, torch.from_numpy(expected), max_diff=2)
