"""Qwen-Image-Edit and Qwen-Image-Edit-Plus in our engine against diffusers'
QwenImageEditPipeline / QwenImageEditPlusPipeline on tiny random folders (float32, true CFG,
several steps): the same prompt embeddings (the Qwen2.5-VL encoder with the images) and the
same packed latents; Edit-Plus with two images of different sizes; bad requests refused.

The reference gets the processor's `mm_token_type_ids` forwarded to its text encoder (diffusers
PR #14189; see omnistage/testing/tiny_qwen_image_edit.py). Sizes are scaled down from ~1024x1024
pixels (`calculate_dimensions`' area) to keep the tiny models fast.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.qwen_image_edit import (CONDITION_AREA, TARGET_AREA,
                                                           QwenImageEditPipeline)
from omnistage.errors import InputError
from omnistage.testing.diffusion import run_to_end
from omnistage.testing.tiny_qwen_image_edit import C, build_tiny_qwen_image_edit
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")
AREA = 64 * 64                  # stands in for 1024 * 1024 pixels
CONDITION = 32 * 32             # stands in for Edit-Plus's 384 * 384
PROMPT = "make the sea shore sunny"
NEGATIVE = "blurry, low quality"
STEPS = 3


def png_bytes(size: tuple[int, int], seed: int) -> bytes:
    """A smooth random RGB image (width, height) as PNG bytes."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize(size, Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def scaled_sizes(monkeypatch: pytest.MonkeyPatch, ours: QwenImageEditPipeline) -> None:
    """Both sides at AREA (and CONDITION) instead of ~1024x1024 (and 384x384) pixels."""
    from diffusers.pipelines.qwenimage import (pipeline_qwenimage_edit as edit,
                                               pipeline_qwenimage_edit_plus as plus)

    areas = {TARGET_AREA: AREA, CONDITION_AREA: CONDITION}
    for module in (edit, plus):
        original = module.calculate_dimensions
        monkeypatch.setattr(module, "calculate_dimensions",
                            lambda area, ratio, f=original: f(areas[area], ratio))
    monkeypatch.setattr(ours, "target_area", AREA)
    monkeypatch.setattr(ours.prompt_encoder, "condition_area",
                        areas[type(ours.prompt_encoder).condition_area])


def load_pair(path: Path, component: str, zero_cond_t: bool = False):
    ref = build_tiny_qwen_image_edit(path, plus=component.endswith("plus"),
                                     zero_cond_t=zero_cond_t)
    ours = golden.load_ours(path, component)
    return ref, ours


@pytest.fixture(scope="module")
def edit_pair(tmp_path_factory: pytest.TempPathFactory):
    return load_pair(tmp_path_factory.mktemp("qwen_image_edit"), "qwen_image_edit")


@pytest.fixture(scope="module")
def plus_pair(tmp_path_factory: pytest.TempPathFactory):
    return load_pair(tmp_path_factory.mktemp("qwen_image_edit_plus"), "qwen_image_edit_plus")


def run_ours(ours: QwenImageEditPipeline, monkeypatch: pytest.MonkeyPatch,
             params: DiffusionParams) -> Tensor:
    """The request's final packed latents, run through the engine."""
    seen = golden.record_latents(ours, monkeypatch)
    engine = DiffusionEngine(ours)
    engine.add_request("a", PROMPT, params)
    run_to_end(engine)
    return seen[params.seed]


def edit_params(images: list[bytes], num_images: int = 1) -> DiffusionParams:
    return DiffusionParams(num_inference_steps=STEPS, true_cfg_scale=4.0,
                           negative_prompt=NEGATIVE, seed=0, num_images=num_images,
                           image=images[0], extra_images=tuple(images[1:]))


def reference(ref, params: DiffusionParams) -> Tensor:
    """diffusers' latents for `params`, its input images as PIL (one alone, or a list)."""
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in (params.image,
                                                               *params.extra_images)]
    return golden.reference(ref, PROMPT, params, "latent", image=pil[0] if len(pil) == 1 else pil)


def test_edit_matches_diffusers(edit_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = edit_pair
    scaled_sizes(monkeypatch, ours)
    image = png_bytes((80, 48), seed=1)                 # encoded at 96x64: 6x4 tokens
    params = edit_params([image], num_images=2)
    golden.assert_latents_match(run_ours(ours, monkeypatch, params), reference(ref, params),
                                shape=(2, 6 * 4, 4 * C))


def test_edit_prompt_embeds_see_the_image(edit_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder's states equal diffusers', and another image changes them clearly."""
    ref, ours = edit_pair
    scaled_sizes(monkeypatch, ours)
    states = []
    for seed in (1, 2):
        pil = Image.open(io.BytesIO(png_bytes((80, 48), seed))).convert("RGB")
        sized = pil.resize((96, 64), Image.Resampling.LANCZOS)
        with torch.no_grad():
            expected, mask = ref.encode_prompt(PROMPT, image=sized, device=torch.device("cpu"))
        (got,) = ours.prompt_encoder.encode_texts([PROMPT], [[sized]])
        assert mask is None and got.shape == expected.shape[1:]
        torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=0)
        states.append(got)
    # a text-encoder stage's way in: the images from the params, resized there
    (cond,) = ours.prompt_encoder.encode([PROMPT], [DiffusionParams(image=png_bytes((80, 48), 2))])
    torch.testing.assert_close(cond["prompt_embeds"], states[1], atol=1e-6, rtol=0)
    image_rows = states[0].shape[0] - len(ours.prompt_encoder.tokenizer(PROMPT).input_ids) - 5
    assert (states[0] - states[1]).abs().max() > 0.1 and image_rows > 0


@pytest.fixture(scope="module")
def plus_2511_pair(tmp_path_factory: pytest.TempPathFactory):
    return load_pair(tmp_path_factory.mktemp("qwen_image_edit_2511"), "qwen_image_edit_plus",
                     zero_cond_t=True)


@pytest.mark.parametrize("pair", ["plus_pair", "plus_2511_pair"], ids=["2509", "2511"])
def test_plus_two_images_match_diffusers(pair: str, request: pytest.FixtureRequest,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Edit-Plus, and Edit-2511's transformer (the input images' tokens modulated at t=0)."""
    ref, ours = request.getfixturevalue(pair)
    scaled_sizes(monkeypatch, ours)
    images = [png_bytes((80, 48), seed=1), png_bytes((48, 64), seed=3)]
    params = edit_params(images)
    # output: the last image's aspect, 64x64 -> 4x4 tokens
    golden.assert_latents_match(run_ours(ours, monkeypatch, params), reference(ref, params),
                                shape=(1, 4 * 4, 4 * C))


def test_same_image_alone_or_batched(plus_pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests with other input images (other img_shapes, one forward each), with and
    without CFG, joining at different steps: each as it is alone."""
    _, ours = plus_pair
    scaled_sizes(monkeypatch, ours)
    a, b = png_bytes((80, 48), seed=1), png_bytes((48, 64), seed=3)
    requests = {
        "two": DiffusionParams(num_inference_steps=3, true_cfg_scale=4.0, negative_prompt=NEGATIVE,
                               seed=0, image=a, extra_images=(b,)),
        "one": DiffusionParams(num_inference_steps=2, seed=1, image=b),
        "same": DiffusionParams(num_inference_steps=2, seed=2, image=b, extra_images=(b,),
                                height=64, width=64),
    }
    batched = DiffusionEngine(ours)
    batched.add_request("two", PROMPT, requests["two"])
    batched.step()
    for rid in ("one", "same"):
        batched.add_request(rid, PROMPT, requests[rid])
    together = run_to_end(batched)
    for rid, params in requests.items():
        engine = DiffusionEngine(ours)
        engine.add_request(rid, PROMPT, params)
        assert torch.equal(run_to_end(engine)[rid].images, together[rid].images), rid


def test_bad_requests_refused(edit_pair, plus_pair) -> None:
    (_, edit), (_, plus) = edit_pair, plus_pair
    image = png_bytes((80, 48), seed=1)
    cases = [
        (edit, DiffusionParams(), "edits an input image"),
        (edit, DiffusionParams(image=image, extra_images=(image,)), "at most 1 input image,"),
        (plus, DiffusionParams(image=image, extra_images=(image,) * 3), "at most 3 input"),
        (edit, DiffusionParams(image=image, strength=0.5), "strength"),
        (edit, DiffusionParams(image=png_bytes((4000, 8), seed=0)), "too elongated"),
        (plus, DiffusionParams(image=image, negative_prompt="<|image_pad|>", true_cfg_scale=4.0),
         "negative_prompt: must not contain"),
    ]
    for pipe, params, message in cases:
        with pytest.raises(InputError, match=message):
            pipe.validate(PROMPT, params)
    with pytest.raises(InputError, match="cannot be decoded"):
        edit.validate(PROMPT, DiffusionParams(image=b"not an image"))
