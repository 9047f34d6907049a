"""Golden: our HunyuanVideo-1.5 image-to-video pipeline against diffusers'
`HunyuanVideo15ImageToVideoPipeline` on the same tiny random folder, float32: final latents for
the same image (its resolution bucket, the crop, SigLIP tokens, the VAE-encoded first frame),
conditioning (fake encoder states as prompt_embeds), seed; a MeanFlow checkpoint's timestep_r;
a request without an image refused naming the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.diffusion_params import DiffusionParams
from omnistage.errors import InputError
from omnistage.testing.diffusion import run_alone
from tests.helpers.diffusion_golden import assert_latents_match
from tests.helpers.hunyuan_video15 import FakePromptEncoder, build_tiny_i2v

pytest.importorskip("diffusers")

PROMPT = "the cat turns its head"


def _image() -> Image.Image:
    g = np.random.default_rng(0)
    return Image.fromarray(g.integers(0, 256, (44, 70, 3), dtype=np.uint8))   # 70 x 44


def _ours(path: Path):
    from omnistage.diffusion.pipelines.hunyuan_video15_i2v import (
        HunyuanVideo15ImageToVideoPipeline)

    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(
        path, "hunyuan_video15_i2v", torch.device("cpu"), torch.float32, text_encoders=False)
    pipe.prompt_encoder = FakePromptEncoder()
    return pipe


def _compare(path: Path, use_meanflow: bool) -> None:
    ref = build_tiny_i2v(path, use_meanflow)
    params = DiffusionParams(num_frames=5, num_inference_steps=3, seed=4, image=_image(),
                             negative_prompt="static")
    got, _ = run_alone(_ours(path), PROMPT, params)
    fake = FakePromptEncoder()
    with torch.no_grad():
        expected = ref(image=_image(), num_frames=5, num_inference_steps=3,
                       generator=torch.Generator().manual_seed(4), output_type="latent",
                       return_dict=False, **fake.padded(PROMPT),
                       **fake.padded("static", "negative_"))[0]
    assert_latents_match(got, expected, atol=2e-4)


def test_latents_match_diffusers(tmp_path: Path) -> None:
    _compare(tmp_path, use_meanflow=False)


def test_meanflow_latents_match_diffusers(tmp_path: Path) -> None:
    _compare(tmp_path, use_meanflow=True)


def test_a_request_without_image_is_refused(tmp_path: Path) -> None:
    build_tiny_i2v(tmp_path)
    with pytest.raises(InputError) as err:
        _ours(tmp_path).validate(PROMPT, DiffusionParams(num_frames=5))
    assert err.value.param == "image"
