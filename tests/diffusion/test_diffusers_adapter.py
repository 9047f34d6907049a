"""The generic diffusers adapter (diffusion/diffusers_pipeline.py, diffusers_engine.py): which
pipeline classes it takes, and on the tiny random SDXL folder, that requests batched into one
diffusers call make the images diffusers makes of each alone, with their progress, aborts and
refused params."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from omnistage.diffusion.diffusers_engine import DiffusersEngine
from omnistage.diffusion.engine import DiffusionResult
from omnistage.diffusion.params import DiffusionParams
from omnistage.errors import InputError

diffusers = pytest.importorskip("diffusers")

from omnistage.diffusion.diffusers_pipeline import DiffusersPipeline, check_supported  # noqa: E402
from omnistage.testing.tiny_sdxl import reference  # noqa: E402

DEADLINE_S = 60


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


def run(engine: DiffusersEngine) -> dict[str, list[DiffusionResult]]:
    """Step until every request has finished -> each one's results, in order."""
    out: dict[str, list[DiffusionResult]] = {}
    deadline = time.monotonic() + DEADLINE_S
    while engine.has_unfinished_requests or engine.call is not None:
        assert time.monotonic() < deadline, "the engine did not finish"
        for r in engine.step():
            out.setdefault(r.request_id, []).append(r)
        time.sleep(0.005)
    return out


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
    results = run(engine)
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
    results = run(engine)
    assert set(results) == {"kept"} and results["kept"][-1].images is not None
    engine.add_request("alone", "a cat", params(3, **long))
    engine.step()
    call = engine.call
    engine.abort("alone")
    assert call is not None and call.cancelled
    assert run(engine) == {}
    assert call.images is None and call.error is None      # stopped, not run to the end


@pytest.mark.parametrize("kw, field", [
    ({"cache_threshold": 0.1}, "cache_threshold"), ({"num_frames": 5}, "num_frames"),
    ({"true_cfg_scale": 4.0}, "true_cfg_scale"), ({"height": 15}, "height")])
def test_params_the_call_cannot_take_are_refused(pipeline: DiffusersPipeline, kw: dict,
                                                 field: str) -> None:
    engine = DiffusersEngine(pipeline)
    with pytest.raises(InputError, match=field) as info:
        engine.add_request("r", "a cat", params(1, **kw))
    assert info.value.param == field and not engine.has_unfinished_requests
