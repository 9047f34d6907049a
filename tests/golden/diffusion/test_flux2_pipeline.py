"""FLUX.2 [klein] in our engine against diffusers' Flux2KleinPipeline on a tiny random pipeline
folder (float32): the same latents for text-to-image with CFG (two images of one request) and
step-distilled (no CFG), and for an edit with two reference images; the same image alone or
batched with requests at other steps; bad requests refused at the boundary."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import Tensor

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.flux2 import Flux2KleinPipeline
from omnistage.testing.diffusion import png, run_to_end
from omnistage.testing.tiny_flux2 import build_tiny_flux2_klein
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

SEQ = 16                        # text max_sequence_length
SIZE = 32                       # pixels; the tiny VAE downsamples 2x: 8x8 tokens of 2x2 patches
PROMPT = "a photo of the sea shore"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[diffusers.Flux2KleinPipeline, Flux2KleinPipeline]:
    path = tmp_path_factory.mktemp("flux2_klein")
    ref = build_tiny_flux2_klein(path)
    ours = golden.load_ours(path, "flux2_klein")
    ours.prompt_encoder.max_sequence_length = SEQ
    return ref, ours


def capture_latents(pipe: Flux2KleinPipeline, monkeypatch: pytest.MonkeyPatch
                    ) -> dict[object, Tensor]:
    """Final latents per request seed, as diffusers' output_type="latent" gives them (raw
    VAE latents (n, C, h, w)), recorded as the engine decodes them."""
    def unpacked(latents: Tensor, params: DiffusionParams) -> Tensor:
        height, width = pipe._size(params)
        patches = latents.transpose(1, 2).unflatten(2, (height // 4, width // 4))
        return pipe.vae.denormalize(patches)

    return golden.record_latents(pipe, monkeypatch, transform=unpacked)


def reference(ref: diffusers.Flux2KleinPipeline, params: DiffusionParams, **kwargs: object
              ) -> Tensor:
    return golden.reference(ref, PROMPT, params, "latent", max_sequence_length=SEQ, **kwargs)


def run(ours: Flux2KleinPipeline, params: DiffusionParams) -> None:
    engine = DiffusionEngine(ours)
    engine.add_request("a", PROMPT, params)
    run_to_end(engine)


def test_text_to_image_with_cfg_matches_diffusers(
        pair: tuple[diffusers.Flux2KleinPipeline, Flux2KleinPipeline],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = pair
    seen = capture_latents(ours, monkeypatch)
    params = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=3,
                             guidance_scale=3.0, seed=0, num_images=2)
    run(ours, params)
    expected = reference(ref, params)
    golden.assert_latents_match(seen[0], expected, shape=(2, 4, SIZE // 2, SIZE // 2),
                                rtol=1e-4)
    assert not torch.equal(expected[0], expected[1])


def test_step_distilled_runs_without_cfg(
        pair: tuple[diffusers.Flux2KleinPipeline, Flux2KleinPipeline],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = pair
    seen = capture_latents(ours, monkeypatch)
    monkeypatch.setattr(ours, "is_distilled", True)
    monkeypatch.setattr(ours.prompt_encoder, "is_distilled", True)
    params = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=3,
                             guidance_scale=3.0, seed=1)
    run(ours, params)
    ref.register_to_config(is_distilled=True)
    try:
        expected = reference(ref, params)
    finally:
        ref.register_to_config(is_distilled=False)
    golden.assert_latents_match(seen[1], expected, rtol=1e-4)
    assert (seen[1] - reference(ref, params)).abs().max() > 1e-2  # CFG moves it


def test_edit_with_two_reference_images_matches_diffusers(
        pair: tuple[diffusers.Flux2KleinPipeline, Flux2KleinPipeline],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two references (cropped to multiples of 4, encoded, appended as tokens at times 10 and
    20); no size given: the first reference's (68x64)."""
    ref, ours = pair
    first, second = png(70, 66, seed=2), png(64, 72, seed=3)
    seen = capture_latents(ours, monkeypatch)
    params = DiffusionParams(num_inference_steps=2, guidance_scale=2.0, seed=4, image=first,
                             extra_images=(second,))
    run(ours, params)
    expected = reference(ref, params, image=[Image.open(io.BytesIO(first)).convert("RGB"),
                                             Image.open(io.BytesIO(second)).convert("RGB")])
    golden.assert_latents_match(seen[4], expected, shape=(1, 4, 32, 34), rtol=1e-4)
    run(ours, DiffusionParams(num_inference_steps=2, guidance_scale=2.0, seed=4, image=first))
    assert (seen[4] - expected).abs().max() > 1e-2          # the second reference matters


def test_same_image_alone_or_batched(
        pair: tuple[diffusers.Flux2KleinPipeline, Flux2KleinPipeline]) -> None:
    """Rows at different steps, with and without CFG and references, share forwards."""
    _, ours = pair
    a = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=3.0,
                        seed=3)
    alone = DiffusionEngine(ours)
    alone.add_request("a", PROMPT, a)
    expected = run_to_end(alone)["a"].images

    batched = DiffusionEngine(ours)
    batched.add_request("b", "the weather today is sunny", DiffusionParams(
        height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=1.0, seed=4,
        image=png(64, 64, seed=5)))
    batched.step()                                       # "a" joins one step behind "b"
    batched.add_request("a", PROMPT, a)
    done = run_to_end(batched)
    assert batched.num_steps_run == 4
    assert (done["a"].images.int() - expected.int()).abs().max() <= 1
    assert done["a"].images.float().std() > 1.0, "the tiny pipeline should not draw flat"


@pytest.mark.parametrize("params, prompt, match", [
    (DiffusionParams(height=34, width=32), PROMPT, "multiple of 4"),
    (DiffusionParams(height=4096, width=32), PROMPT, "maximum is 2048"),
    (DiffusionParams(height=32, width=32, true_cfg_scale=4.0), PROMPT, "true_cfg_scale"),
    (DiffusionParams(height=32, width=32, guidance_scale=1.0, negative_prompt="blurry"), PROMPT,
     "no effect"),
    (DiffusionParams(height=32, width=32), "  ", "non-empty"),
    (DiffusionParams(image=png(48, 64, seed=1)), PROMPT, r"image\[0\]: 48x64 is too small"),
    (DiffusionParams(image=png(64, 64, seed=1), extra_images=(png(600, 64, seed=2),)), PROMPT,
     r"image\[1\]: 600x64 has an aspect ratio"),
    (DiffusionParams(image=png(64, 64, seed=1), strength=0.5), PROMPT, "strength"),
    (DiffusionParams(image=png(64, 64, seed=1), extra_images=(b"not an image",)), PROMPT,
     "cannot be decoded"),
])
def test_refuses_bad_requests(pair: tuple[diffusers.Flux2KleinPipeline, Flux2KleinPipeline],
                              params: DiffusionParams, prompt: str, match: str) -> None:
    engine = DiffusionEngine(pair[1])
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished_requests


def test_served_through_omni_by_its_default_graph(
        pair: tuple[diffusers.Flux2KleinPipeline, Flux2KleinPipeline], tmp_path: Path) -> None:
    """The registry row and default graph: an edit with two references through Omni (the
    files through the connector), and a bad size refused."""
    from omnistage import Omni

    ref, ours = pair
    folder = tmp_path / "flux2_klein"
    ref.save_pretrained(folder)
    edit = DiffusionParams(num_inference_steps=2, seed=1, image=png(64, 72, seed=1),
                           extra_images=(png(80, 64, seed=2),))
    engine = DiffusionEngine(ours)
    engine.add_request("a", "a red cube", edit)
    expected = run_to_end(engine)["a"].images
    with Omni(str(folder), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate("a red cube", edit)
        assert out.error is None and out.images[0].size == (64, 72)
        assert (out.tensors["images"].int() - expected.int()).abs().max() <= 1
        (bad,) = omni.generate("a red cube", DiffusionParams(height=33, width=32))
        assert bad.finish_reason == "error" and "multiple of" in str(bad.error)


def test_large_reference_is_prepared_as_diffusers_does() -> None:
    """Past 1024^2 pixels a reference is Lanczos-scaled to that area, then center-cropped to a
    multiple of 16 (Flux2ImageProcessor; no VAE needed to check it)."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    from omnistage.diffusion.pipelines.flux2 import reference_pixels

    image = Image.open(io.BytesIO(png(1250, 900, seed=6))).convert("RGB")
    processor = Flux2ImageProcessor(vae_scale_factor=16)
    scaled = processor._resize_to_target_area(image, 1024 * 1024)
    w, h = scaled.width // 16 * 16, scaled.height // 16 * 16
    expected = processor.preprocess(scaled, height=h, width=w, resize_mode="crop")
    got = reference_pixels(image, 16)
    assert got.shape == expected.shape == (1, 3, 864, 1200)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
