"""GPU-only: a diffusion stage's memory budget on CUDA's own counters (diffusion/memory.py),
on a tiny random FLUX pipeline in float32 at sizes whose activations are megabytes. The fit
of the measured peaks predicts a size no step ran; the steps of a bounded engine stay under
its limit; a real out-of-memory error (a per-process cap) fails its request alone, leaves
nothing allocated behind, and the next request completes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from omnistage.diffusion.engine import DiffusionEngine, DiffusionResult
from omnistage.diffusion.memory import CudaProbe, MemoryBudget, row_size
from omnistage.diffusion.params import DiffusionParams
from omnistage.registry import load_component

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = "a photo of the sea shore"
MIB = 2**20


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("diffusers")
    path = Path(__file__).parents[1] / "golden" / "diffusion" / "test_flux_pipeline.py"
    spec = importlib.util.spec_from_file_location("_gpu_flux_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    folder = tmp_path_factory.mktemp("flux")
    mod.build_reference(folder, guidance_embeds=True)
    pipe = load_component("diffusion", "flux").from_pretrained(
        folder, "flux", torch.device("cuda"), torch.float32)
    pipe.prompt_encoder.max_sequence_length = mod.SEQ
    return pipe


def bounded(pipe, limit: int | None = None) -> DiffusionEngine:
    """An engine with a budget of `limit` bytes (None: the whole device), profiled."""
    probe = CudaProbe(torch.device("cuda"))
    engine = DiffusionEngine(pipe, max_num_seqs=8,
                             memory=MemoryBudget(probe, limit or probe.total()))
    engine.profile_memory()
    return engine


def params(size: int, seed: int = 0, num_images: int = 1) -> DiffusionParams:
    return DiffusionParams(height=size, width=size, num_inference_steps=2, seed=seed,
                           num_images=num_images)


def run(engine: DiffusionEngine) -> dict[str, DiffusionResult]:
    done = {}
    for _ in range(100):
        if not engine.has_unfinished_requests:
            return done
        done.update({r.request_id: r for r in engine.step() if r.finished})
    raise AssertionError("the engine did not finish its requests in 100 steps")


def test_the_fit_predicts_a_size_no_step_ran(flux) -> None:
    engine = bounded(flux)
    for size in (128, 384):              # with the profile's default (256 px): three sizes
        engine.add_request(f"r{size}", PROMPT, params(size))
        assert run(engine)[f"r{size}"].error is None
    engine.add_request("new", PROMPT, params(512))
    size = row_size(engine.requests["new"])
    predicted = engine.memory.fit.predict(size)
    assert run(engine)["new"].error is None
    measured = engine.memory.fit.points[size]
    print(json.dumps({"points_mib": {s: round(b / MIB, 2) for s, b in
                                     engine.memory.fit.points.items()},
                      "predicted_mib": round(predicted / MIB, 2)}))
    assert 0.8 * measured <= predicted <= 1.5 * measured, (predicted, measured)


def test_the_steps_stay_under_the_limit(flux) -> None:
    """Room for 2.5 requests' peaks as measured alone: steps of two, each step's peak under
    the limit, every request complete."""
    engine = bounded(flux)
    engine.add_request("first", PROMPT, params(384, seed=9))    # its size measured alone
    assert run(engine)["first"].error is None
    for i in range(6):
        engine.add_request(f"r{i}", PROMPT, params(384, seed=i))
    cost = engine.memory.cost(engine.requests["r0"])
    engine.memory.limit = engine.memory.probe.allocated() + int(2.5 * cost)
    peaks, rows = [], []
    velocity = flux.velocity

    def metered(latents, sigmas, requests):
        out = velocity(latents, sigmas, requests)
        peaks.append(torch.cuda.max_memory_allocated())        # since the step's start
        rows.append(latents.shape[0])
        return out

    flux.velocity = metered
    try:
        done = run(engine)
    finally:
        del flux.velocity
    assert all(r.error is None for r in done.values()) and len(done) == 6
    assert max(rows) == 2 and sum(rows) == 6 * 2, rows
    assert max(peaks) <= engine.memory.limit, (max(peaks) / MIB, engine.memory.limit / MIB)


def test_a_real_out_of_memory_fails_its_request_alone(flux) -> None:
    """A per-process cap leaves room for a small request's step but not a large one's: the
    large one fails with the out-of-memory error, its activations are given back, and the
    engine goes on serving."""
    engine = bounded(flux)
    (small,) = engine.memory.fit.points.values()        # the profile's: 256 px, per image
    engine.add_request("big", PROMPT, params(1024, num_images=4))
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    room = max(16 * small, 64 * MIB)
    allowed = torch.cuda.memory_reserved() + room
    assert engine.memory.cost(engine.requests["big"]) > 2 * room     # admitted, cannot fit
    before = torch.cuda.memory_allocated()
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        done = run(engine)
        engine.add_request("after", PROMPT, params(256, seed=1))
        done |= run(engine)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert done["big"].error.message.startswith("out of memory: this request alone (4 image(s)"), \
        done["big"].error
    assert done["after"].error is None
    assert torch.cuda.memory_allocated() <= before + MIB    # the failed step left nothing
