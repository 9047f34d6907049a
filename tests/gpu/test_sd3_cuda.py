"""GPU-only (skipped without CUDA): the SD3 pipeline on CUDA against diffusers'
StableDiffusion3Pipeline on CUDA, float32 with TF32 off, on the tiny folder of
tests/golden/diffusion/test_sd3_pipeline.py: served through `Omni` (its transformer forwards replayed
from CUDA graphs, on by default on CUDA), and in-process with skip-layer guidance. What these
catch is placement and graph capture, not numerics, which the CPU golden test pins down."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from omnistage import DiffusionParams, Omni

pytestmark = [pytest.mark.usefixtures("no_tf32"), pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _golden_module():
    path = Path(__file__).parents[1] / "golden" / "diffusion" / "test_sd3_pipeline.py"
    spec = importlib.util.spec_from_file_location("_gpu_test_sd3_pipeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sd3_on_cuda_equals_diffusers(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    mod = _golden_module()
    ref = mod.build_reference(tmp_path / "sd3")
    ref.to("cuda")
    # (2, 3, H, W) in [0, 1]; Omni's prompt encoder keeps T5's default 256 tokens
    expected = mod.reference(ref, "pt", max_sequence_length=256)
    expected = (expected * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()
    params = [DiffusionParams(height=mod.HEIGHT, width=mod.WIDTH, seed=s,
                              num_inference_steps=mod.STEPS, guidance_scale=mod.GUIDANCE,
                              negative_prompt=mod.NEGATIVE) for s in mod.SEEDS]
    with Omni(str(tmp_path / "sd3"), device="cuda", dtype="float32",
              stage_overrides=["backend=inproc", "connector=inproc",
                               "dit.diffusion.cuda_graphs=true"]) as omni:
        for _ in range(2):                  # the second round replays the captured graphs
            outs = [omni.generate(p, q)[0] for p, q in zip(mod.PROMPTS, params)]
            assert [o.error for o in outs] == [None, None]
            got = torch.cat([o.tensors["images"] for o in outs])
            assert (got.int() - expected.int()).abs().max() <= 2


def test_sd3_skip_layer_guidance_on_cuda(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    from omnistage.diffusion.pipelines.sd3 import SkipLayerGuidance, StableDiffusion3Pipeline

    mod = _golden_module()
    ref = mod.build_reference(tmp_path / "sd3")
    ref.to("cuda")
    expected = mod.reference(ref, "latent", skip_guidance_layers=[1],
                             skip_layer_guidance_scale=2.8, skip_layer_guidance_start=0.1,
                             skip_layer_guidance_stop=0.7)
    ours = StableDiffusion3Pipeline.from_pretrained(tmp_path / "sd3", "sd3",
                                                    torch.device("cuda"), torch.float32)
    ours.prompt_encoder.max_sequence_length = mod.SEQ
    ours.use_skip_layer_guidance(SkipLayerGuidance(layers=(1,), start=0.1, stop=0.7))
    got = torch.cat([latents for latents, _ in mod.run_ours(ours)])
    torch.testing.assert_close(got.cpu(), expected.cpu(), atol=1e-3, rtol=0)
