"""Wan text-to-video through our engine against diffusers' `WanPipeline` on a tiny random
folder (float32): the same final latents and frames with and without guidance, each request
alone equal to it batched with others at other steps, bad sizes and frame counts refused, and
the folder served by `Omni` with its default graph (videos out)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.registry import load_component
from omnistage.testing.diffusion import run_alone, run_staggered
from omnistage.testing.tiny_wan import build_tiny_wan
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")

H, W, FRAMES = 32, 48, 5            # 8x VAE: 4 x 6 latents, 2 latent frames; 2x2 patches
PROMPT = "a cat walking on the beach"
NEGATIVE = "blurry"
@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("wan")
    ref = build_tiny_wan(path)
    ours = golden.load_ours(path, "wan")
    return path, ref, ours


def params(guidance: float, seed: int = 0, steps: int = 4) -> DiffusionParams:
    return DiffusionParams(height=H, width=W, num_frames=FRAMES, num_inference_steps=steps,
                           guidance_scale=guidance, seed=seed,
                           negative_prompt=NEGATIVE if guidance > 1 else None)


@pytest.mark.parametrize("guidance", [1.0, 5.0], ids=["no-cfg", "cfg"])
def test_matches_diffusers(pair, guidance: float) -> None:
    _, ref, ours = pair
    run = golden.matches_diffusers(ref, ours, PROMPT, params(guidance), image_atol=None,
                                   output="np", min_abs_mean=0.1)
    assert run.output.shape == (1, FRAMES, H, W, 3)


def test_requests_at_different_steps_equal_each_alone(pair) -> None:
    _, _, ours = pair
    jobs = {"a": (PROMPT, params(5.0, seed=1, steps=5)),
            "b": ("a dog", params(1.0, seed=2, steps=3)),
            "c": ("waves", params(3.0, seed=3, steps=4))}

    batched, engine = run_staggered(ours, jobs)     # a, then b a step later, then c
    assert engine.num_steps_run == 6                  # c joined at a's step 2: 2 + 4
    for rid, (prompt, p) in jobs.items():
        latents, _ = run_alone(ours, prompt, p)
        assert (batched[rid][0] - latents).abs().max() < 1e-5, rid


@pytest.mark.parametrize("field, value, match", [
    ("num_frames", 6, "1 \\+ a multiple of 4"), ("height", 40, "height"),
    ("width", 20, "width")])
def test_refuses_bad_shapes(pair, field: str, value: int, match: str) -> None:
    _, _, ours = pair
    p = dataclasses.replace(params(1.0), **{field: value})
    with pytest.raises(ValueError, match=match):
        DiffusionEngine(ours).add_request("x", PROMPT, p)


def test_served_by_omni_with_its_default_graph(pair) -> None:
    from omnistage import Omni

    path, _, _ = pair
    with Omni(str(path), device="cpu", backend="inproc", connector="inproc") as omni:
        (out,) = omni.generate([PROMPT], [params(1.0, steps=2)])
    video = out.tensors["video"]
    assert video.shape == (1, FRAMES, H, W, 3) and video.dtype == torch.uint8


def test_runs_in_bfloat16_with_its_float32_tables(pair) -> None:
    """Loaded in bf16, the modulation tables and norms stay float32 (as diffusers keeps them)
    while the pipeline computes in bf16: a step and a decode run (the first parameter,
    scale_shift_table, once made the pipeline feed float32 to bf16 convolutions)."""
    path, _, _ = pair
    pipe = load_component("diffusion", "wan").from_pretrained(path, "wan", torch.device("cpu"),
                                                              torch.bfloat16)
    assert pipe.transformer.scale_shift_table.dtype == torch.float32
    assert pipe.dtype == torch.bfloat16
    latents, video = run_alone(pipe, PROMPT, params(5.0, steps=2))
    assert torch.isfinite(latents).all() and video.shape == (1, FRAMES, H, W, 3)
