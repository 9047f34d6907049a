"""Golden: BAGEL as a diffusion pipeline (omnistage/diffusion/pipelines/bagel.py) stepped by our
diffusion engine gives the upstream code's images (tests/fixtures/bagel/, see
scripts/bagel_fixtures.py): text-to-image and an edit, on the same tiny seeded checkpoint, with
the fixtures' byte-level token ids; the engine's Euler step and the request's seed reproduce
the upstream loop and its torch.manual_seed."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.bagel import (BagelOptions, BagelPipeline,
                                                 BagelThinkPipeline, resize_size)
from omnistage.errors import InputError
from omnistage.models.bagel.model import Bagel
from omnistage.payloads import TOKEN_IDS
from omnistage.testing.diffusion import run_to_end
from tests.helpers.bagel import ByteTokenizer, expected, manifest, write_checkpoint


class ByteTokens:
    """The fixtures' tokenizer: bytes, then the four special tokens at 256.."""
    unk_token_id = None

    def __init__(self, special: dict[str, int]) -> None:
        names = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
        keys = ("bos_token_id", "eos_token_id", "start_of_image", "end_of_image")
        self.ids = {n: special[k] for n, k in zip(names, keys)}

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.ids[token]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("bagel") / "BAGEL-tiny")
    model, vae = Bagel.from_pretrained(folder)
    return BagelPipeline(model, vae, ByteTokens(manifest()["special_tokens"]),
                         torch.device("cpu"))


def _options(case: dict) -> BagelOptions:
    return BagelOptions(cfg_img_scale=case["cfg_img_scale"],
                        cfg_interval=tuple(case["cfg_interval"]),
                        cfg_renorm_min=case["cfg_renorm_min"],
                        cfg_renorm_type=case["cfg_renorm_type"],
                        timestep_shift=case["timestep_shift"],
                        vae_min_size=16, vit_min_size=16)   # the 24x32 input kept as is


def _png(pixels: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("name", ["t2i", "edit"])
def test_engine_images_equal_upstream(pipeline, name):
    case, exp = manifest()["cases"][name], expected()
    pipeline.configure(_options(case))
    h, w = case["image_hw"]
    if name == "edit":
        params = DiffusionParams(seed=case["seed"], guidance_scale=case["cfg_text_scale"],
                                 num_inference_steps=case["num_timesteps"] - 1,
                                 image=_png(exp["edit.input_image"]))
    else:
        params = DiffusionParams(seed=case["seed"], guidance_scale=case["cfg_text_scale"],
                                 num_inference_steps=case["num_timesteps"] - 1,
                                 height=h, width=w)
    engine = DiffusionEngine(pipeline)
    engine.add_request("r", case["prompt"], params)
    image = run_to_end(engine)["r"].images[0]
    want = exp[f"{name}.image"]
    assert image.shape == want.shape and want.float().std() > 5
    assert (image.int() - want.int()).abs().max() <= 1


def test_upstream_resize_rule():
    # the upstream's own numbers: 1024 long side, 512 short side, stride 16 (and ViT 980/224/14)
    assert resize_size(1920, 1080, 1024, 512, 16) == (1024, 576)
    assert resize_size(300, 200, 1024, 512, 16) == (768, 512)
    assert resize_size(768, 512, 980, 224, 14) == (770, 518)


def test_bad_requests_name_their_field(pipeline):
    with pytest.raises(InputError) as e:
        pipeline.validate("a cat", DiffusionParams(negative_prompt="dog"))
    assert e.value.param == "negative_prompt"
    with pytest.raises(InputError) as e:
        pipeline.validate("a cat", DiffusionParams(height=30, width=28))
    assert e.value.param == "size"
    with pytest.raises(InputError) as e:
        pipeline.validate("", DiffusionParams(height=20, width=28))
    assert e.value.param == "prompt"


def test_two_requests_stepped_together_equal_upstream(pipeline):
    """A text-to-image and an edit (other sizes, guidance and contexts) stepped side by side
    in one engine: the edit equals the upstream's image. The shared options are the edit's; the text-to-image
    case's differ in shift and renorm, so it runs with the edit's and is checked against
    itself run alone."""
    m, exp = manifest(), expected()
    edit, t2i = m["cases"]["edit"], m["cases"]["t2i"]
    pipeline.configure(_options(edit))
    h, w = t2i["image_hw"]
    alone = DiffusionEngine(pipeline)
    t2i_params = DiffusionParams(seed=t2i["seed"], guidance_scale=t2i["cfg_text_scale"],
                                 num_inference_steps=t2i["num_timesteps"] - 1, height=h, width=w)
    alone.add_request("t", t2i["prompt"], t2i_params)
    t2i_alone = run_to_end(alone)["t"].images[0]
    engine = DiffusionEngine(pipeline)
    engine.add_request("e", edit["prompt"], DiffusionParams(
        seed=edit["seed"], guidance_scale=edit["cfg_text_scale"],
        num_inference_steps=edit["num_timesteps"] - 1, image=_png(exp["edit.input_image"])))
    engine.add_request("t", t2i["prompt"], t2i_params)
    out = run_to_end(engine)
    assert (out["e"].images[0].int() - exp["edit.image"].int()).abs().max() <= 1
    assert torch.equal(out["t"].images[0], t2i_alone)


def test_think_mode_equals_upstream(tmp_path_factory):
    """Think mode (BagelThinkPipeline): the request prepared with the upstream's system prompt,
    parked, then given the understanding stage's answer (the upstream's planning tokens) as
    the edge und -> dit brings it: the upstream think-mode image."""
    m, exp = manifest(), expected()
    case = m["cases"]["think"]
    folder = write_checkpoint(tmp_path_factory.mktemp("bagel") / "BAGEL-tiny")
    model, vae = Bagel.from_pretrained(folder)
    pipe = BagelThinkPipeline(model, vae, ByteTokenizer(), torch.device("cpu"))
    pipe.configure(_options(case))
    h, w = case["image_hw"]
    engine = DiffusionEngine(pipe)
    engine.add_request("r", case["prompt"], DiffusionParams(
        seed=case["seed"], guidance_scale=case["cfg_text_scale"],
        num_inference_steps=case["num_timesteps"] - 1, height=h, width=w), parked=True)
    assert engine.is_parked("r")
    answer = exp["think.tokens"][1:]          # without the start token the upstream returns
    with pytest.raises(ValueError, match="token_ids"):
        engine.set_conditioning("r", {"x": answer})
    engine.set_conditioning("r", {TOKEN_IDS: answer})
    image = run_to_end(engine)["r"].images[0]
    want = exp["think.image"]
    assert image.shape == want.shape and want.float().std() > 5
    assert (image.int() - want.int()).abs().max() <= 1
