"""FLUX.2 [dev] in our engine against diffusers' Flux2Pipeline on a tiny random pipeline folder
(float32): Mistral-3 text encoder (system message, layers 10, 20, 30), the guidance scale in
the guidance embedding, no CFG; the same latents for two images of one request and for an
edit with a reference image; a negative prompt refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.flux2 import Flux2Pipeline
from omnistage.testing.diffusion import png, run_to_end
from omnistage.testing.tiny_flux2 import build_tiny_flux2_dev
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

SEQ = 24                        # text max_sequence_length: the system message is truncated
SIZE = 32
PROMPT = "a photo of the sea shore"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[diffusers.Flux2Pipeline, Flux2Pipeline]:
    path = tmp_path_factory.mktemp("flux2")
    ref = build_tiny_flux2_dev(path)
    ours = golden.load_ours(path, "flux2")
    ours.prompt_encoder.max_sequence_length = SEQ
    return ref, ours


def run(ours: Flux2Pipeline, params: DiffusionParams) -> None:
    engine = DiffusionEngine(ours)
    engine.add_request("a", PROMPT, params)
    run_to_end(engine)


def test_matches_diffusers(pair: tuple[diffusers.Flux2Pipeline, Flux2Pipeline],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    ref, ours = pair
    seen = golden.record_latents(ours, monkeypatch, key=lambda p: p.guidance_scale)
    params = DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=2, guidance_scale=2.5,
                             seed=0, num_images=2)
    run(ours, params)
    expected = golden.reference(ref, PROMPT, params, "latent", max_sequence_length=SEQ)
    # dev's output_type="latent" is the packed tokens (klein's: the unpacked latents)
    golden.assert_latents_match(seen[2.5], expected, shape=(2, (SIZE // 4) ** 2, 16), rtol=1e-4)
    run(ours, DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=2,
                              guidance_scale=5.0, seed=0, num_images=2))
    assert (seen[5.0] - expected).abs().max() > 1e-2      # the guidance embedding is live


def test_edit_with_a_reference_image_matches_diffusers(
        pair: tuple[diffusers.Flux2Pipeline, Flux2Pipeline],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from PIL import Image

    ref, ours = pair
    seen = golden.record_latents(ours, monkeypatch)
    image = png(72, 64, seed=5)
    params = DiffusionParams(num_inference_steps=2, guidance_scale=3.0, seed=1, image=image)
    run(ours, params)
    expected = golden.reference(ref, PROMPT, params, "latent", max_sequence_length=SEQ,
                                image=Image.open(io.BytesIO(image)).convert("RGB"))
    golden.assert_latents_match(seen[1], expected, shape=(1, 16 * 18, 16), rtol=1e-4)


def test_refuses_cfg_fields(pair: tuple[diffusers.Flux2Pipeline, Flux2Pipeline]) -> None:
    engine = DiffusionEngine(pair[1])
    with pytest.raises(ValueError, match="negative_prompt: has no effect"):
        engine.add_request("x", PROMPT, DiffusionParams(height=SIZE, width=SIZE,
                                                        guidance_scale=4.0, negative_prompt="x"))


@pytest.mark.parametrize("name", ["chat_template.json", "chat_template.jinja"])
def test_tokenizer_takes_the_processors_chat_template(tmp_path: Path, name: str) -> None:
    """FLUX.2-dev's tokenizer/ is a Pixtral processor's folder: the template may sit in the
    processor's file only."""
    import json

    from omnistage.diffusion.pipelines.flux2_text import load_tokenizer
    from omnistage.testing.tiny_flux2 import CONTENT_TEMPLATE
    from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(tmp_path)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    for leftover in tmp_path.glob("chat_template.*"):
        leftover.unlink()
    (tmp_path / name).write_text(json.dumps({"chat_template": CONTENT_TEMPLATE})
                                 if name.endswith(".json") else CONTENT_TEMPLATE)
    assert load_tokenizer(tmp_path).chat_template == CONTENT_TEMPLATE
