"""Wan image-to-video through our engine against diffusers' `WanImageToVideoPipeline` on tiny
random folders (float32). Wan2.1 I2V: the same final latents and frames with and without
guidance from a first frame of another aspect (stretched to the asked size), requests at
different steps and with different images (one step-cached) equal to each alone, a request without an image
refused, the folder's family, graph and VideoSpec, and a folder with TI2V's first-frame latents
refused. Wan2.2 I2V-A14B: two requests at different steps, sharing an expert's call or on
different experts, each with its own image and scale per expert, equal to diffusers'."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

from omnistage import registry
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines import wan_i2v
from omnistage.testing.diffusion import recording_experts, run_alone, run_staggered
from omnistage.testing.tiny_wan import build_tiny_wan22_i2v, build_tiny_wan_i2v
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")

H, W, FRAMES = 32, 48, 5            # 8x VAE: 4 x 6 latents, 2 latent frames; 2x2 patches
PROMPT = "a cat walking on the beach"
NEGATIVE = "blurry"


def first_frame(seed: int, size: tuple[int, int] = (40, 56)) -> Image.Image:
    """A smooth picture with some noise, (height, width) = size: not the output's aspect."""
    g = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[0], 0:size[1]]
    base = np.stack([x / size[1], y / size[0], 0.5 + 0.5 * np.sin(x / 4 + seed)], -1)
    pixels = np.clip(base * 200 + g.normal(0, 20, (*size, 3)), 0, 255)
    return Image.fromarray(pixels.astype(np.uint8))


def load(tmp_path_factory: pytest.TempPathFactory, build) -> Iterator[tuple]:
    """(path, diffusers' pipeline, ours) of a folder `build` saves; while in use, diffusers'
    I2V cleans prompts as its T2V does (it calls ftfy, not installed, even for ASCII)."""
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    path = tmp_path_factory.mktemp(build.__name__)
    ref = build(path)
    family = registry.family_of_folder(path)
    ours = registry.load_component("diffusion", family.components[0].name).from_pretrained(
        path, "wan_i2v", torch.device("cpu"), torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline_wan_i2v, "basic_clean", pipeline_wan.basic_clean)
        yield path, ref, ours


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    yield from load(tmp_path_factory, build_tiny_wan_i2v)


@pytest.fixture(scope="module")
def a14b(tmp_path_factory: pytest.TempPathFactory):
    yield from load(tmp_path_factory, build_tiny_wan22_i2v)


def params(guidance: float, seed: int = 0, steps: int = 4, image: int = 0,
           guidance_2: float | None = None) -> DiffusionParams:
    return DiffusionParams(height=H, width=W, num_frames=FRAMES, num_inference_steps=steps,
                           guidance_scale=guidance, guidance_scale_2=guidance_2, seed=seed,
                           image=first_frame(image),
                           negative_prompt=NEGATIVE if guidance > 1 else None)


def reference(ref, p: DiffusionParams, image: int = 0, prompt: str = PROMPT,
              decode: bool = True) -> tuple[Tensor, Tensor | None]:
    """diffusers' final latents (1, z, F', h, w) and, with decode, frames (1, F, H, W, 3) in
    [0, 1] for the request p with first frame `image`."""
    final = {}

    def keep(pipe, i: int, t: Tensor, tensors: dict) -> dict:
        final["latents"] = tensors["latents"]
        return tensors

    frames = golden.reference(ref, prompt, p, "np" if decode else "latent",
                              image=first_frame(image), callback_on_step_end=keep)
    return final["latents"], frames if decode else None


@pytest.mark.parametrize("guidance", [1.0, 5.0], ids=["no-cfg", "cfg"])
def test_matches_diffusers(pair, guidance: float) -> None:
    _, ref, ours = pair
    latents, video = run_alone(ours, PROMPT, params(guidance))
    expected, frames = reference(ref, params(guidance))
    golden.assert_latents_match(latents, expected, shape=(1, 4, 2, 4, 6), min_abs_mean=0.1)
    other, _ = reference(ref, params(guidance), image=1, decode=False)   # the image matters
    assert (other - expected).abs().max() > 1e-2
    golden.assert_output_matches(video, frames)
    assert video.shape == (1, FRAMES, H, W, 3)


def test_requests_at_different_steps_equal_each_alone(pair) -> None:
    _, _, ours = pair
    jobs = {"a": (PROMPT, params(5.0, seed=1, steps=5)),
            "b": ("a dog", params(1.0, seed=2, steps=3, image=1)),
            "c": ("waves", dataclasses.replace(params(3.0, seed=3, steps=4, image=2),
                                               cache_threshold=100.0))}  # skips steps 1, 2
    batched, engine = run_staggered(ours, jobs)
    assert engine.num_steps_run == 6                  # c joined at a's step 2: 2 + 4
    for rid, (prompt, p) in jobs.items():
        alone, _ = run_alone(ours, prompt, p)
        assert (batched[rid][0] - alone).abs().max() < 1e-5, rid


def test_needs_a_first_frame_and_says_what_it_makes(pair) -> None:
    path, _, ours = pair
    p = dataclasses.replace(params(1.0), image=None)
    with pytest.raises(ValueError, match="first frame"):
        DiffusionEngine(ours).add_request("x", PROMPT, p)
    spec = registry.video_spec(path)
    assert spec.image_to_video and not spec.text_to_video and spec.default_size == (832, 480)
    hub = Path("hub/models--Wan-AI--Wan2.1-I2V-14B-720P-Diffusers/snapshots/0a1b")
    assert wan_i2v.video_spec(hub).default_size == (1280, 720)
    assert registry.family_of_folder(path).graph == "wan_i2v.yaml"


def test_refuses_first_frame_latents(tmp_path: Path) -> None:
    """An image-to-video folder with TI2V's expand_timesteps: its first frame is not a
    condition of channels, so it is refused before any weight loads."""
    index = {"_class_name": "WanImageToVideoPipeline", "expand_timesteps": True}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="expand_timesteps"):
        wan_i2v.WanImageToVideoPipeline.from_pretrained(tmp_path, "wan_i2v",
                                                        torch.device("cpu"), torch.float32)


def test_a14b_two_requests_at_different_steps_match_diffusers(a14b) -> None:
    """Timesteps 999, 900 | 750, 500 (boundary 875), b a step behind a: they share the
    high-noise expert's call, then a is on the low-noise one while b is still on the high,
    then they share the low-noise one; each with its own image and scales per expert."""
    path, ref, ours = a14b
    assert registry.family_of_folder(path).name == "wan_i2v" and ours.image_encoder is None
    jobs = {"a": (PROMPT, params(6.0, seed=1, guidance_2=2.0)),
            "b": ("a dog", params(3.0, seed=2, image=1, guidance_2=5.0))}
    with recording_experts(ours) as calls:
        batched, _ = run_staggered(ours, jobs)
    assert calls == [[0, "a"], [0, "a", "b"], [0, "b"], [1, "a"], [1, "a", "b"], [1, "b"]]
    for rid, (prompt, p) in jobs.items():
        expected, _ = reference(ref, p, image=int(rid == "b"), prompt=prompt, decode=False)
        golden.assert_latents_match(batched[rid][0], expected, min_abs_mean=0.1)
