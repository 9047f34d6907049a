"""The diffusion engine: step-level batching, seeds, abort and bad input, on the digits DiT
with random weights (the shipped weights are checked for quality in test_digits_dit.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage.diffusion.engine import DiffusionEngine, DiffusionResult
from omnistage.diffusion.params import DiffusionParams
from omnistage.errors import InputError
from omnistage.diffusion.pipelines.digits import DigitsPipeline
from omnistage.models.digits_dit import DigitsDiT, DigitsDiTConfig, sample
from omnistage.ranges import numeric_fields


@pytest.fixture(scope="module")
def pipeline() -> DigitsPipeline:
    torch.manual_seed(0)
    model = DigitsDiT(DigitsDiTConfig(hidden_size=64, num_layers=2, num_heads=4))
    with torch.no_grad():
        for p in model.parameters():  # adaLN-Zero starts at zero: make every path matter
            p.normal_(0.0, 0.2)
    return DigitsPipeline(model, torch.device("cpu"))


def run(engine: DiffusionEngine) -> dict[str, DiffusionResult]:
    done = {}
    while engine.has_unfinished_requests:
        for r in engine.step():
            if r.finished:
                done[r.request_id] = r
    return done


def test_matches_the_reference_sampler(pipeline: DigitsPipeline) -> None:
    engine = DiffusionEngine(pipeline)
    params = DiffusionParams(num_inference_steps=6, guidance_scale=3.0, seed=7, num_images=2)
    engine.add_request("a", "a handwritten 4", params)
    (res,) = run(engine).values()
    ref = sample(pipeline.model, torch.tensor([4, 4]), num_steps=6, guidance_scale=3.0,
                 generator=torch.Generator().manual_seed(7))
    assert res.error is None and res.images.shape == (2, 64, 64, 1)
    assert torch.equal(res.images, pipeline.decode(ref, params))


def test_same_image_alone_and_in_a_batch_joined_at_different_steps(
        pipeline: DigitsPipeline) -> None:
    target = DiffusionParams(num_inference_steps=8, seed=123)
    alone = DiffusionEngine(pipeline)
    alone.add_request("t", "seven", target)
    ref = run(alone)["t"].images

    engine = DiffusionEngine(pipeline, max_num_seqs=4)
    engine.add_request("o1", "one", DiffusionParams(num_inference_steps=12, seed=1))
    engine.step()
    engine.step()
    engine.add_request("t", "seven", target)               # joins o1 at its step 2
    engine.step()
    engine.add_request("o2", "two", DiffusionParams(num_inference_steps=5, seed=2,
                                                    guidance_scale=1.0, num_images=3))
    engine.add_request("o3", "three", DiffusionParams(num_inference_steps=20))
    steps_before = engine.num_steps_run
    done = run(engine)
    assert set(done) == {"o1", "t", "o2", "o3"}
    assert torch.equal(done["t"].images, ref)
    # four requests shared forwards: far fewer than the sum of their remaining steps
    assert engine.num_steps_run - steps_before < 9 + 7 + 5 + 20


def test_seed_decides_the_image(pipeline: DigitsPipeline) -> None:
    engine = DiffusionEngine(pipeline)
    for rid, seed in (("a", 5), ("b", 5), ("c", 6)):
        engine.add_request(rid, "eight", DiffusionParams(num_inference_steps=4, seed=seed))
    done = run(engine)
    assert torch.equal(done["a"].images, done["b"].images)
    assert not torch.equal(done["a"].images, done["c"].images)


def test_abort_frees_the_request(pipeline: DigitsPipeline) -> None:
    engine = DiffusionEngine(pipeline)
    engine.add_request("a", "zero", DiffusionParams(num_inference_steps=50))
    engine.add_request("b", "nine", DiffusionParams(num_inference_steps=3))
    progress = {r.request_id: r.progress for r in engine.step()}
    assert progress == {"a": pytest.approx(1 / 50), "b": pytest.approx(1 / 3)}
    assert engine.progress("a") == pytest.approx(1 / 50)
    assert engine.abort("a") is not None
    assert engine.abort("a") is None
    done = run(engine)
    assert set(done) == {"b"} and not engine.has_unfinished_requests


@pytest.mark.parametrize("prompt, kwargs, message", [
    ("a cat", {}, "names no digit"),
    ("seven", {"height": 60}, "multiple of 8"),
    ("seven", {"width": 1024}, "maximum is 512"),
])
def test_bad_input_is_a_clear_error(pipeline: DigitsPipeline, prompt: str, kwargs: dict,
                                    message: str) -> None:
    engine = DiffusionEngine(pipeline)
    engine.add_request("ok", "one", DiffusionParams(num_inference_steps=2))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, DiffusionParams(**kwargs))
    assert set(engine.requests) == {"ok"}
    assert run(engine)["ok"].error is None


@pytest.mark.parametrize("kwargs, field", [
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": 201}, "num_inference_steps"),
    ({"num_images": 11}, "num_images"),
    ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"height": -8}, "height"),
])
def test_bad_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DiffusionParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"negative_prompt": "a six"}, "negative_prompt"),
    ({"true_cfg_scale": 4.0}, "true_cfg_scale"),
])
def test_options_the_demo_lacks_are_refused(pipeline: DigitsPipeline, kwargs: dict,
                                            field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DiffusionEngine(pipeline).add_request("x", "seven", DiffusionParams(**kwargs))


@pytest.fixture(scope="module")
def shipped() -> DigitsPipeline:
    return DigitsPipeline(DigitsDiT.from_pretrained(None), torch.device("cpu"))


def test_step_caching(shipped: DigitsPipeline) -> None:
    def run_all(threshold: float | None) -> dict[str, DiffusionResult]:
        engine = DiffusionEngine(shipped)
        for d in range(3):
            engine.add_request(f"c{d}", str(d), DiffusionParams(
                num_inference_steps=20, seed=d, num_images=4, cache_threshold=threshold))
        engine.add_request("plain", "eight", DiffusionParams(num_inference_steps=20, seed=9))
        return run(engine)

    base, zero, cached = run_all(None), run_all(0.0), run_all(0.1)
    for rid in base:
        # threshold 0 never skips and equals no caching exactly
        assert torch.equal(zero[rid].images, base[rid].images)
        assert zero[rid].metrics.num_steps_skipped == 0
    for d in range(3):
        res = cached[f"c{d}"]
        assert 5 <= res.metrics.num_steps_skipped <= 18  # first and last steps always run
        diff = (res.images.float() - base[f"c{d}"].images.float()).abs().mean()
        assert diff < 8.0, diff                               # mean over 0..255 pixels
    # a request without caching in the same batches is untouched
    assert torch.equal(cached["plain"].images, base["plain"].images)
    assert cached["plain"].metrics.num_steps_skipped == 0


def test_an_input_image_is_decoded_once(pipeline: DigitsPipeline,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine decodes an image-to-image request's file once and hands the image to the
    pipeline's validate and prepare; the result equals the pipeline decoding it itself."""
    import io

    from PIL import Image

    from omnistage.diffusion import image_input

    buf = io.BytesIO()
    Image.fromarray((np.arange(64 * 64 * 3) % 251).astype(np.uint8).reshape(64, 64, 3)).save(
        buf, format="PNG")
    params = DiffusionParams(num_inference_steps=6, seed=3, image=buf.getvalue(), strength=0.5)
    calls = []
    decode = image_input.decode_image
    monkeypatch.setattr(image_input, "decode_image", lambda *a: calls.append(1) or decode(*a))
    engine = DiffusionEngine(pipeline)
    engine.add_request("a", "a 3", params)
    assert len(calls) == 1
    prepared = engine.requests["a"]
    latents, sigmas, _ = pipeline.prepare("a 3", params,
                                          torch.Generator().manual_seed(3))  # decodes itself
    assert len(calls) == 2
    assert torch.equal(prepared.latents, latents) and torch.equal(prepared.sigmas, sigmas)
    assert sigmas.numel() == 4                  # strength 0.5 of 6 steps: image-to-image ran
    run(engine)


def test_a_multistep_solver_keeps_each_requests_history(pipeline: DigitsPipeline) -> None:
    """A pipeline's own solver (flow UniPC: it remembers earlier outputs): requests joining
    at different steps end as each does alone (their histories do not mix), and not as
    flow-match Euler ends them."""
    import copy

    from omnistage.diffusion.solvers.unipc_flow import FlowUniPC, UniPCConfig, UniPCState

    unipc = copy.copy(pipeline)
    unipc.solver = FlowUniPC(UniPCConfig(flow_shift=3.0))
    params = {"a": DiffusionParams(num_inference_steps=7, seed=3),
              "b": DiffusionParams(num_inference_steps=5, seed=4, num_images=2)}

    def alone(pipe, rid: str) -> torch.Tensor:
        engine = DiffusionEngine(pipe)
        engine.add_request(rid, "three", params[rid])
        return run(engine)[rid].images

    engine = DiffusionEngine(unipc)
    engine.add_request("a", "three", params["a"])
    engine.step()
    engine.step()
    engine.add_request("b", "three", params["b"])
    assert isinstance(engine.requests["b"].solver_state, UniPCState)
    assert engine.requests["a"].solver_state is not engine.requests["b"].solver_state
    done = run(engine)
    assert engine.num_steps_run == 7                      # b joined a's batch at its step 2
    for rid in params:
        assert torch.equal(done[rid].images, alone(unipc, rid)), rid
    assert not torch.equal(done["a"].images, alone(pipeline, "a"))


class Poisoned:
    """The digits pipeline, except that a forward whose batch holds a request of `raises`
    fails, and the rows of a request of `overflows` come back as inf (what a guidance of
    1e39 did to a real model's latents)."""

    def __init__(self, inner: DigitsPipeline, raises: set[str], overflows: set[str]) -> None:
        self.inner, self.raises, self.overflows = inner, raises, overflows

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def velocity(self, latents: torch.Tensor, sigmas: torch.Tensor, requests: list
                 ) -> torch.Tensor:
        if any(r.request_id in self.raises for r in requests):
            raise RuntimeError("poisoned forward")
        v = self.inner.velocity(latents, sigmas, requests)
        rows = torch.tensor([r.request_id in self.overflows for r in requests])
        return torch.where(rows.view(-1, *[1] * (v.dim() - 1)), float("inf"), v)


def test_a_poisoned_request_fails_alone_and_the_rest_of_its_batch_completes(
        pipeline: DigitsPipeline) -> None:
    """A forward that raises is run again per request; latents that turn inf fail their
    request only. The others' images equal what each gives alone."""
    params = {rid: DiffusionParams(num_inference_steps=3, seed=i)
              for i, rid in enumerate(("a", "raises", "b", "overflows", "c"))}
    engine = DiffusionEngine(Poisoned(pipeline, {"raises"}, {"overflows"}), max_num_seqs=8)
    for rid, p in params.items():
        engine.add_request(rid, "a three", p)
    done = run(engine)
    assert "poisoned forward" in str(done["raises"].error)
    assert "no longer finite after step 1 of 3" in str(done["overflows"].error)
    for rid in ("a", "b", "c"):
        alone = DiffusionEngine(pipeline)
        alone.add_request(rid, "a three", params[rid])
        assert done[rid].error is None
        assert torch.equal(done[rid].images, run(alone)[rid].images)
    assert not engine.has_unfinished_requests


@pytest.mark.parametrize("field", sorted(numeric_fields(DiffusionParams)))
@pytest.mark.parametrize("value", [2**64, -2**64, float("nan"), float("inf"), 1e39, True, "1"])
def test_every_numeric_param_is_checked_for_kind_finiteness_and_range(field: str,
                                                                      value: object) -> None:
    """Every numeric field has a range (ranges.py), and out-of-range, non-finite, overflowing
    and mistyped values are an InputError naming it."""
    kwargs = {field: value, **({"image": b"\x89PNG"} if field == "strength" else {})}
    with pytest.raises(InputError, match=field) as err:
        DiffusionParams(**kwargs)
    assert err.value.param == field
