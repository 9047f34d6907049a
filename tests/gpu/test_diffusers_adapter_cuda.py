"""GPU-only (skipped without CUDA): the generic diffusers adapter on CUDA, float32 with TF32
off: two requests batched into one diffusers call on the call's own thread equal diffusers'
own call on CUDA for each alone (CPU generators, as the adapter gives each request). What this
catches is placement (the call's thread on the wrong device, generators on the wrong one);
numerics are tests/golden/diffusion/test_diffusers_adapter.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.diffusion.diffusers_engine import DiffusersEngine
from omnistage.diffusion.diffusers_pipeline import DiffusersPipeline
from omnistage.diffusion.params import DiffusionParams
from omnistage.testing.diffusion import run_whole_calls
from omnistage.testing.tiny_sdxl import build_tiny_sdxl, reference

diffusers = pytest.importorskip("diffusers")

pytestmark = [pytest.mark.usefixtures("no_tf32"), pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_batched_call_on_cuda_equals_diffusers_alone(tmp_path: Path) -> None:
    build_tiny_sdxl(tmp_path)
    device = torch.device("cuda")
    pipeline = DiffusersPipeline.from_pretrained(tmp_path, "diffusers", device, torch.float32)
    assert pipeline.pipe.device.type == "cuda"
    engine = DiffusersEngine(pipeline)
    size = {"height": 32, "width": 32, "num_inference_steps": 3, "guidance_scale": 3.0}
    cases = {"cat": ("a cat", 1), "dog": ("a dog", 2)}
    for rid, (prompt, seed) in cases.items():
        engine.add_request(rid, prompt, DiffusionParams(**size, seed=seed))
    results = run_whole_calls(engine)
    assert engine.num_calls == 1
    ref = diffusers.DiffusionPipeline.from_pretrained(tmp_path).to(device)
    for rid, (prompt, seed) in cases.items():
        expected = reference(ref, prompt, seed, **size)
        got = results[rid][-1].images
        assert got.shape == expected.shape and expected.float().std() > 20
        assert (got.int() - expected.int()).abs().max() <= 1, rid
