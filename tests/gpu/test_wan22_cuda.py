"""GPU-only (skipped without CUDA): the Wan2.2 pipelines on CUDA against diffusers on CUDA,
float32 with TF32 off, through the engine: A14B with two requests on different experts in
one batch, TI2V with a first-image request and a text one in one batch. What this catches is
placement (a mask, a row index or the image latents left on the CPU), not numerics, which
tests/golden/diffusion/test_wan22_pipeline.py pins down."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.diffusion.pipelines.wan import WanPipeline
from omnistage.testing.diffusion import run_staggered
from omnistage.testing.tiny_wan import build_tiny_wan22_a14b, build_tiny_wan22_ti2v

pytestmark = [pytest.mark.usefixtures("no_tf32"), pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cpu_test_module():
    path = Path(__file__).parents[1] / "golden" / "diffusion" / "test_wan22_pipeline.py"
    spec = importlib.util.spec_from_file_location("_gpu_test_wan22_pipeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["a14b", "ti2v"])
def test_wan22_on_cuda_equals_diffusers(variant: str, tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    mod = _cpu_test_module()
    build, size = ((build_tiny_wan22_a14b, mod.A14B_SIZE) if variant == "a14b"
                   else (build_tiny_wan22_ti2v, mod.TI2V_SIZE))
    ref = build(tmp_path)
    ref.to("cuda")
    ours = WanPipeline.from_pretrained(tmp_path, "wan", torch.device("cuda"), torch.float32)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), np.uint8))
    first = mod.params(size, 6.0, 2.0 if variant == "a14b" else None, seed=1,
                       image=image if variant == "ti2v" else None)
    jobs = {"a": (mod.PROMPT, first), "b": (mod.PROMPT, mod.params(size, 3.0, seed=2))}
    batched, _ = run_staggered(ours, jobs, lag=2)     # a at step 2 (A14B: low), b at 0
    for rid, (_, p) in jobs.items():
        with torch.no_grad():
            expected = (mod.i2v_reference(ref, p, image) if p.image is not None
                        else mod.reference(ref, p))
        assert (batched[rid][0].cpu() - expected.cpu()).abs().max() < 1e-3, rid
