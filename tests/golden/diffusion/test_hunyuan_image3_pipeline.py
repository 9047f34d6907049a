"""HunyuanImage3Pipeline in our engine against the upstream HunyuanImage-3.0 code (fixtures of
tests/fixtures/hunyuan_image3, made by scripts/hunyuan_image3_fixtures.py at the commit its
manifest names): the prompt through our template and the folder's tokenizer, the noise from the
request's seed, the engine's steps -> the upstream's final latents and image."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.hunyuan_image3 import HunyuanImage3Pipeline
from omnistage.testing.diffusion import run_to_end
from tests.helpers import diffusion_golden as golden
from tests.helpers.hunyuan_image3 import build_checkpoint, expected, manifest


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("hi3"))


@pytest.fixture(scope="module")
def pipe(folder: Path) -> HunyuanImage3Pipeline:
    return HunyuanImage3Pipeline.from_pretrained(folder, "hunyuan_image3", torch.device("cpu"),
                                                 torch.float32)


def case_params(case: dict, **over) -> DiffusionParams:
    h, w = case["image_size"]
    return DiffusionParams(**(dict(height=h, width=w, num_inference_steps=case["steps"],
                                   guidance_scale=case["guidance_scale"],
                                   flow_shift=case["flow_shift"], seed=case["seeds"][0]) | over))


def test_both_cases_in_one_engine_match_upstream(pipe, monkeypatch) -> None:
    seen = golden.record_latents(pipe, monkeypatch, key=lambda p: p.seed)
    cases = {k: c for k, c in manifest()["cases"].items() if "image_size" in c}
    exp = expected()
    engine = DiffusionEngine(pipe)
    for name, case in cases.items():
        engine.add_request(name, case["prompts"][0], case_params(case))
    done = run_to_end(engine)
    vae = pipe.model.cfg.vae
    for name, case in cases.items():
        want = (exp[f"{name}.vae_input"][:, :, 0] - vae.shift_factor) * vae.scaling_factor
        golden.assert_latents_match(seen[case["seeds"][0]], want, atol=2e-4)
        image = exp[f"{name}.image"][:, :, 0]
        golden.assert_output_matches(done[name].images, (image / 2 + 0.5).clamp(0, 1))


def test_num_images(pipe) -> None:
    """Two images of one request: the first is the seed's single image, the second another
    draw; no guidance given: the checkpoint's generation_config."""
    case = manifest()["cases"]["square"]
    engine = DiffusionEngine(pipe)
    size = dict(height=32, width=32, num_inference_steps=2, seed=5)
    engine.add_request("one", case["prompts"][0], DiffusionParams(**size))
    engine.add_request("two", case["prompts"][0], DiffusionParams(**size, num_images=2))
    done = run_to_end(engine)
    one, two = done["one"].images, done["two"].images
    assert one.shape == (1, 32, 32, 3) and two.shape == (2, 32, 32, 3)
    assert (one.int() - two[:1].int()).abs().max() <= 1
    assert (two[0].int() - two[1].int()).abs().max() > 2


def test_no_size_lets_the_model_pick_the_ratio(pipe) -> None:
    """Without a size the model answers its ratio token (upstream image_size "auto"), falling
    back to 1:1 when the token is no ratio; the latent grid is the size floored to the VAE's
    factor (42x22 -> 40x20), as upstream."""
    rows = manifest()["cases"]["ratio"]["rows"]
    assert [pipe.auto_ratio(r["prompt"]) for r in rows] == [r["ratio_index"] for r in rows]
    engine = DiffusionEngine(pipe)
    engine.add_request("auto", rows[2]["prompt"], DiffusionParams(num_inference_steps=1, seed=2))
    h, w = rows[2]["size"]
    assert run_to_end(engine)["auto"].images.shape == (1, h // 4 * 4, w // 4 * 4, 3)


@pytest.mark.parametrize("params, prompt, field", [
    (DiffusionParams(height=30, width=30), "a cat", "size"),
    (DiffusionParams(height=34, width=30), "a cat", "size"),       # in the group, not /4
    (DiffusionParams(negative_prompt="dog"), "a cat", "negative_prompt"),
    (DiffusionParams(image=b"\x89PNG"), "a cat", "image"),
    (DiffusionParams(), "  ", "prompt"),
])
def test_refuses_bad_requests(pipe, params: DiffusionParams, prompt: str, field: str) -> None:
    engine = DiffusionEngine(pipe)
    with pytest.raises(ValueError, match=field) as err:
        engine.add_request("x", prompt, params)
    assert getattr(err.value, "param", field) == field
    assert not engine.has_unfinished_requests


def test_served_through_omni_by_its_default_graph(folder: Path) -> None:
    from omnistage import Omni

    with Omni(str(folder), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate("a red cat", DiffusionParams(height=28, width=36,
                                                            num_inference_steps=2, seed=1))
        assert out.error is None and out.images[0].size == (36, 28)
        (bad,) = omni.generate("a red cat", DiffusionParams(height=30, width=30))
        assert bad.finish_reason == "error" and "size" in str(bad.error)


def test_bfloat16_runs_near_float32(folder: Path) -> None:
    """The serving dtype on GPUs: rope in float32 and q/k back in bfloat16 as upstream; the image
    stays near the float32 one (the upstream's)."""
    pipe16 = HunyuanImage3Pipeline.from_pretrained(folder, "hunyuan_image3", torch.device("cpu"),
                                                   torch.bfloat16)
    case = manifest()["cases"]["wide"]
    engine = DiffusionEngine(pipe16)
    engine.add_request("a", case["prompts"][0], case_params(case))
    got = run_to_end(engine)["a"].images[0].float()
    want = ((expected()["wide.image"][0, :, 0].permute(1, 2, 0) / 2 + 0.5).clamp(0, 1) * 255)
    assert (got - want.round()).abs().mean() < 6
