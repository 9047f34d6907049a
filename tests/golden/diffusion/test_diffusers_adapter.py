"""The generic diffusers adapter (diffusion/diffusers_pipeline.py, diffusers_engine.py): which
pipeline classes it takes, and on the tiny random SDXL folder, that requests batched into one
diffusers call make the images diffusers makes of each alone, with their progress, aborts and
refused params."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omnistage.diffusion.diffusers_engine import DiffusersEngine
from omnistage.diffusion.diffusers_pipeline import DiffusersPipeline, check_supported
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion_params import LoraRequest
from omnistage.errors import InputError
from omnistage.testing.diffusion import run_whole_calls
from omnistage.testing.tiny_sdxl import reference

diffusers = pytest.importorskip("diffusers")


@pytest.mark.parametrize("name", ["StableDiffusionXLPipeline", "PixArtAlphaPipeline",
                                  "AmusedPipeline"])       # the last: no return annotation
def test_text_to_image_pipelines_are_taken(name: str) -> None:
    assert check_supported(name).__name__ == name


@pytest.mark.parametrize("name, why", [
    ("AudioLDM2Pipeline", "outputs audio"), ("AudioLDMPipeline", "outputs audio"),
    ("ShapEPipeline", "makes 3D assets"), ("DDPMPipeline", "takes no text prompt"),
    ("CogVideoXPipeline", "outputs video"), ("KandinskyV22PriorPipeline", "outputs other"),
    ("NoSuchPipeline", "has no such pipeline class")])
def test_other_pipelines_are_refused_naming_the_class(name: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"{name}.*{why}"):
        check_supported(name)


@pytest.fixture(scope="module")
def pipeline(tiny_sdxl: Path) -> DiffusersPipeline:
    return DiffusersPipeline.from_pretrained(tiny_sdxl, "diffusers", torch.device("cpu"), None)


def params(seed: int, **kw: object) -> DiffusionParams:
    return DiffusionParams(**{"height": 16, "width": 16, "num_inference_steps": 2,
                              "seed": seed, "guidance_scale": 3.0, **kw})


def test_a_batched_call_equals_diffusers_for_each_request_alone(
        pipeline: DiffusersPipeline) -> None:
    engine = DiffusersEngine(pipeline, max_num_seqs=4)
    cases = {"cat": ("a cat", params(1)), "dog": ("a dog", params(2)),
             "wide": ("a dog", params(2, width=24))}          # another size: its own call
    for rid, (prompt, p) in cases.items():
        engine.add_request(rid, prompt, p)
    results = run_whole_calls(engine)
    assert engine.num_calls == 2
    for rid, (prompt, p) in cases.items():
        *progress, last = results[rid]
        assert [r.progress for r in progress] == [0.5, 1.0]    # one per denoising step
        assert last.finished and last.error is None and last.metrics.num_steps == 2
        expected = reference(pipeline.pipe, prompt, p.seed, height=p.height, width=p.width,
                             num_inference_steps=2, guidance_scale=3.0)
        assert expected.float().std() > 20                      # an image, not a flat field
        assert last.images.shape == expected.shape
        assert (last.images.int() - expected.int()).abs().max() <= 1, rid
    # the batch's two requests differ (their own prompts and seeds went to their own rows)
    assert (results["cat"][-1].images.int() - results["dog"][-1].images.int()).abs().max() > 30


def test_abort_drops_a_request_and_stops_a_call_left_empty(
        pipeline: DiffusersPipeline) -> None:
    engine = DiffusersEngine(pipeline)
    long = {"num_inference_steps": 50}          # the call outlasts the test's next lines
    engine.add_request("kept", "a cat", params(1, **long))
    engine.add_request("gone", "a dog", params(2, **long))
    engine.step()
    assert engine.num_running == 2
    engine.abort("gone")
    results = run_whole_calls(engine)
    assert set(results) == {"kept"} and results["kept"][-1].images is not None
    engine.add_request("alone", "a cat", params(3, **long))
    engine.step()
    call = engine.call
    engine.abort("alone")
    assert call is not None and call.cancelled
    assert run_whole_calls(engine) == {}
    assert call.images is None and call.error is None      # stopped, not run to the end


@pytest.mark.parametrize("kw, field", [
    ({"cache_threshold": 0.1}, "cache_threshold"), ({"num_frames": 5}, "num_frames"),
    ({"true_cfg_scale": 4.0}, "true_cfg_scale"), ({"height": 15}, "height"),
    ({"lora": LoraRequest("a", "/x.safetensors")}, "lora")])
def test_params_the_call_cannot_take_are_refused(pipeline: DiffusersPipeline, kw: dict,
                                                 field: str) -> None:
    engine = DiffusersEngine(pipeline)
    with pytest.raises(InputError, match=field) as info:
        engine.add_request("r", "a cat", params(1, **kw))
    assert info.value.param == field and not engine.has_unfinished_requests


class OlderCallPipeline:
    """A pipeline with PixArt-Alpha's older call (no callback_on_step_end, `callback` each
    `callback_steps`, no negative prompt): records what it was called with."""

    vae_scale_factor = 8

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, prompt: list[str], num_inference_steps: int, generator: list,
                 output_type: str, height: int | None = None, width: int | None = None,
                 num_images_per_prompt: int = 1, callback=None, callback_steps: int = 1):
        self.calls.append({"prompt": prompt, "generator": generator, "steps": callback_steps})
        if "fail" in prompt:
            raise RuntimeError("the pipeline broke")
        for i in range(num_inference_steps):
            callback(i, 999 - i, None)
        n = len(prompt) * num_images_per_prompt
        return SimpleNamespace(images=np.stack([np.full((height, width, 3), k / n)
                                                for k in range(n)]).astype(np.float32))


def test_an_older_call_reports_steps_through_its_callback() -> None:
    fake = OlderCallPipeline()
    engine = DiffusersEngine(DiffusersPipeline(fake, torch.device("cpu")))
    with pytest.raises(InputError, match="takes no negative_prompt"):
        engine.add_request("r", "x", params(1, negative_prompt="blurry", guidance_scale=None))
    with pytest.raises(InputError, match="must be a multiple of 8"):
        engine.add_request("r", "x", params(1, height=12, guidance_scale=None))
    for rid, seed in (("a", 1), ("b", 2)):
        engine.add_request(rid, rid, params(seed, height=8, width=8, num_images=2,
                                            guidance_scale=None))
    results = run_whole_calls(engine)
    (call,) = fake.calls
    assert call["prompt"] == ["a", "b"] and call["steps"] == 1
    # each request's generator drew its images: the same object twice, a's then b's
    gens = call["generator"]
    assert gens[0] is gens[1] and gens[2] is gens[3] and gens[0] is not gens[2]
    assert [r.progress for r in results["a"][:-1]] == [0.5, 1.0]
    assert results["a"][-1].images.shape == (2, 8, 8, 3)
    assert results["b"][-1].images[1].max() == round(255 * 3 / 4)    # b's rows: the last two


def test_a_failing_call_fails_its_requests_and_the_engine_goes_on() -> None:
    engine = DiffusersEngine(DiffusersPipeline(OlderCallPipeline(), torch.device("cpu")))
    for rid in ("fail", "with it"):
        engine.add_request(rid, rid, params(1, height=8, width=8, guidance_scale=None))
    results = run_whole_calls(engine)
    assert {rid: rs[-1].error.message for rid, rs in results.items()} == {
        "fail": "RuntimeError: the pipeline broke", "with it": "RuntimeError: the pipeline broke"}
    engine.add_request("next", "next", params(1, height=8, width=8, guidance_scale=None))
    assert run_whole_calls(engine)["next"][-1].images is not None
