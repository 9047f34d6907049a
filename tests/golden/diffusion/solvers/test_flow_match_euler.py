"""Golden tests: flow-matching Euler vs diffusers' FlowMatchEulerDiscreteScheduler, bit for bit.

Each case is a scheduler_config.json as the checkpoint ships it plus what its pipeline passes to
`set_timesteps` (custom sigmas, mu from the image sequence length).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from omnistage.diffusion.solvers.flow_match_euler import (
    FlowMatchEuler,
    FlowMatchEulerConfig,
    calculate_shift,
    make_sigmas,
    scale_noise,
    step,
    timesteps_for_strength,
)

diffusers = pytest.importorskip("diffusers")
FlowMatchEulerDiscreteScheduler = diffusers.FlowMatchEulerDiscreteScheduler

HEADER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.35.0"}


def FLUX_SIGMAS(n: int) -> np.ndarray:   # pipeline_flux.py, pipeline_qwenimage.py
    return np.linspace(1.0, 1 / n, n)


def ZIMAGE_SIGMAS(n: int) -> list[float]:   # pipeline_z_image.py: get_default_z_image_sigmas
    return torch.linspace(1.0, 1 / n, n).tolist()


# name -> (scheduler_config.json, custom sigmas(n) or None, image_seq_len for mu or None)
CASES: dict[str, tuple[dict, Callable[[int], object] | None, int | None]] = {
    "default": ({}, None, None),
    "sd3": ({"shift": 3.0}, None, None),
    "flux-dev-1024": ({"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096,
                       "max_shift": 1.15, "num_train_timesteps": 1000, "shift": 3.0,
                       "use_dynamic_shifting": True}, FLUX_SIGMAS, 64 * 64),
    "flux-dev-512": ({"shift": 3.0, "use_dynamic_shifting": True}, FLUX_SIGMAS, 32 * 32),
    "qwen-image-1328": ({"base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False,
                         "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000,
                         "shift": 1.0, "shift_terminal": 0.02, "stochastic_sampling": False,
                         "time_shift_type": "exponential", "use_beta_sigmas": False,
                         "use_dynamic_shifting": True, "use_exponential_sigmas": False,
                         "use_karras_sigmas": False}, FLUX_SIGMAS, 83 * 83),
    "z-image-turbo": ({"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0},
                      ZIMAGE_SIGMAS, 64 * 64),   # mu is passed but unused: no dynamic shifting
    "dynamic-linear": ({"use_dynamic_shifting": True, "time_shift_type": "linear"}, None, 4096),
    "karras": ({"shift": 3.0, "use_karras_sigmas": True}, None, None),
    "exponential": ({"shift": 3.0, "use_exponential_sigmas": True}, None, None),
    "inverted": ({"invert_sigmas": True}, None, None),
}


def setup(name: str, n: int, device: str | None = None):
    """-> (our config, our (sigmas, timesteps), a diffusers scheduler after set_timesteps)."""
    raw, sigma_fn, seq_len = CASES[name]
    cfg = FlowMatchEulerConfig.from_dict({**HEADER, **raw})
    mu = None if seq_len is None else calculate_shift(
        seq_len, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)
    custom = None if sigma_fn is None else sigma_fn(n)
    ref = FlowMatchEulerDiscreteScheduler.from_config(raw)
    if custom is None:  # FLUX-style pipelines call set_timesteps(sigmas=..., mu=...) with no n
        ref.set_timesteps(n, device=device, mu=mu)
    else:
        ref.set_timesteps(sigmas=custom, device=device, mu=mu)
    return cfg, make_sigmas(cfg, n, mu=mu, sigmas=custom, device=device), ref


def assert_same(ours: Tensor, ref: Tensor) -> None:
    assert (ours.dtype, ours.shape) == (ref.dtype, ref.shape), (ours.dtype, ours.shape, ref.dtype)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name,n", [(name, n) for name in CASES for n in (1, 4, 28)
                                    if (name, n) != ("qwen-image-1328", 1)])  # see next test
def test_make_sigmas_equals_set_timesteps(name: str, n: int) -> None:
    _, (sigmas, timesteps), ref = setup(name, n)
    assert sigmas.shape == (n + 1,) and timesteps.shape == (n,)
    assert_same(sigmas, ref.sigmas)
    assert_same(timesteps, ref.timesteps)


def test_shift_terminal_one_step() -> None:
    """One step has sigma_0 = 1, and stretching to shift_terminal divides by 1 - 1: diffusers
    returns NaN sigmas (a NaN image), we refuse."""
    raw, sigma_fn, _ = CASES["qwen-image-1328"]
    ref = FlowMatchEulerDiscreteScheduler.from_config(raw)
    with np.errstate(invalid="ignore"):
        ref.set_timesteps(sigmas=sigma_fn(1), mu=0.8)
    assert ref.sigmas[0].isnan()
    with pytest.raises(ValueError, match="shift_terminal"):
        make_sigmas(FlowMatchEulerConfig.from_dict(raw), 1, mu=0.8, sigmas=sigma_fn(1))


def test_calculate_shift_equals_pipelines() -> None:
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_shift
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift as qwen_shift

    assert calculate_shift(4096) == flux_shift(4096)
    assert calculate_shift(6889, 256, 8192, 0.5, 0.9) == qwen_shift(6889, 256, 8192, 0.5, 0.9)


def reference_loop(ref, sample: Tensor, outs: list[Tensor], begin: int = 0) -> Tensor:
    ref.set_begin_index(begin)
    for t, out in zip(ref.timesteps[begin:], outs, strict=True):
        sample = ref.step(out, t, sample).prev_sample
    return sample


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4, 28])
@pytest.mark.parametrize("name", list(CASES))
def test_step_for_step(name: str, n: int, dtype: torch.dtype) -> None:
    _, (sigmas, _), ref = setup(name, n)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, generator=g).to(dtype)   # (B, tokens, channels), FLUX-packed
    outs = [torch.randn(2, 16, 8, generator=g).to(dtype) for _ in range(n)]
    ours_int = ours_vec = x
    for i, out in enumerate(outs):
        ours_int = step(out, ours_int, sigmas, i)
        ours_vec = step(out, ours_vec, sigmas, torch.full((2,), i))
    expected = reference_loop(ref, x, outs)
    assert_same(ours_int, expected)
    assert_same(ours_vec, expected)


def test_rows_at_different_steps() -> None:
    _, (sigmas, _), _ = setup("flux-dev-1024", 28)
    g = torch.Generator().manual_seed(1)
    x, out = torch.randn(3, 16, 8, generator=g), torch.randn(3, 16, 8, generator=g)
    idx = torch.tensor([0, 2, 5])
    batched = step(out, x, sigmas, idx)
    for b, i in enumerate(idx.tolist()):
        assert_same(batched[b:b + 1], step(out[b:b + 1], x[b:b + 1], sigmas, i))
        ref = setup("flux-dev-1024", 28)[2]  # diffusers: one scheduler per request, its own index
        ref.set_begin_index(i)
        expected = ref.step(out[b:b + 1], ref.timesteps[i], x[b:b + 1]).prev_sample
        assert_same(batched[b:b + 1], expected)


def test_per_row_sigmas_continuous_batching() -> None:
    """Three requests with their own schedules share every step they are all alive for."""
    rows = [("flux-dev-1024", 4), ("qwen-image-1328", 9), ("sd3", 28)]
    setups = [setup(name, n) for name, n in rows]
    # (3, 29): each row its own schedule, shorter ones padded after their final 0
    sigmas = torch.stack([F.pad(s, (0, 29 - s.numel())) for _, (s, _), _ in setups])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 16, 8, generator=g)
    outs = [[torch.randn(16, 8, generator=g) for _ in range(n)] for _, n in rows]
    num_steps = torch.tensor([n for _, n in rows])
    idx, cur = torch.zeros(3, dtype=torch.long), x.clone()
    while (alive := idx < num_steps).any():
        out = torch.stack([outs[b][min(i, len(outs[b]) - 1)] for b, i in enumerate(idx.tolist())])
        cur[alive] = step(out[alive], cur[alive], sigmas[alive], idx[alive])
        idx += alive.long()
    for b, (_, _, ref) in enumerate(setups):
        assert_same(cur[b:b + 1], reference_loop(ref, x[b:b + 1], [o[None] for o in outs[b]]))
    rowwise = torch.stack([step(x[b], x[b], sigmas[b], 0) for b in range(3)])
    assert_same(step(x, x, sigmas, 0), rowwise)   # int step_idx with per-row sigmas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["sd3", "flux-dev-1024", "qwen-image-1328"])
def test_scale_noise(name: str, dtype: torch.dtype) -> None:
    _, (sigmas, timesteps), ref = setup(name, 28)
    g = torch.Generator().manual_seed(3)
    image, noise = (torch.randn(2, 16, 8, generator=g).to(dtype) for _ in range(2))
    for t_start in (0, 7, 27):
        ref.set_begin_index(t_start)  # what get_timesteps does before prepare_latents
        expected = ref.scale_noise(image, timesteps[t_start:t_start + 1].repeat(2), noise)
        assert_same(scale_noise(image, sigmas[t_start], noise), expected)
    per_row = scale_noise(image, sigmas[torch.tensor([3, 9])], noise)
    assert_same(per_row[1:], scale_noise(image[1:], sigmas[9], noise[1:]))


@pytest.mark.parametrize("n", [1, 4, 28, 50])
def test_strength_start_index_equals_get_timesteps(n: int) -> None:
    from diffusers import FluxImg2ImgPipeline  # its get_timesteps reads only self.scheduler

    _, (_, timesteps), ref = setup("flux-dev-1024", n)
    holder = type("Holder", (), {"scheduler": ref})()
    for strength in (0.0, 0.1, 0.3, 0.6, 0.75, 0.95, 1.0):
        ref_timesteps, ref_num = FluxImg2ImgPipeline.get_timesteps(holder, n, strength, "cpu")
        t_start = timesteps_for_strength(n, strength)
        assert ref.begin_index == t_start and ref_num == n - t_start, (strength, t_start)
        assert_same(timesteps[t_start:], ref_timesteps)


def test_img2img_end_to_end() -> None:
    _, (sigmas, timesteps), ref = setup("flux-dev-1024", 28)
    g = torch.Generator().manual_seed(4)
    image, noise = torch.randn(1, 16, 8, generator=g), torch.randn(1, 16, 8, generator=g)
    t_start = timesteps_for_strength(28, 0.6)
    outs = [torch.randn(1, 16, 8, generator=g) for _ in range(28 - t_start)]
    ours = scale_noise(image, sigmas[t_start], noise)
    for i, out in enumerate(outs, start=t_start):
        ours = step(out, ours, sigmas, i)
    ref.set_begin_index(t_start)
    start = ref.scale_noise(image, timesteps[t_start:t_start + 1], noise)
    assert_same(ours, reference_loop(ref, start, outs, begin=t_start))


def test_config_from_json(tmp_path: Path) -> None:
    path = tmp_path / "scheduler_config.json"
    path.write_text(json.dumps({**HEADER, **CASES["qwen-image-1328"][0]}))
    cfg = FlowMatchEulerConfig.from_json(path)
    assert cfg == FlowMatchEulerConfig(use_dynamic_shifting=True, max_image_seq_len=8192,
                                       max_shift=0.9, shift_terminal=0.02)


def test_rejects_what_it_cannot_match() -> None:
    with pytest.raises(NotImplementedError, match="stochastic_sampling"):
        FlowMatchEulerConfig(stochastic_sampling=True)
    with pytest.raises(NotImplementedError, match="use_beta_sigmas"):
        FlowMatchEulerConfig(use_beta_sigmas=True)
    with pytest.raises(ValueError, match="time_shift_type"):
        FlowMatchEulerConfig(time_shift_type="cosine")
    with pytest.raises(ValueError, match="mu"):
        make_sigmas(FlowMatchEulerConfig(use_dynamic_shifting=True), 4)
    with pytest.raises(ValueError, match="sigmas"):
        make_sigmas(FlowMatchEulerConfig(), 4, sigmas=[1.0, 0.5])
    with pytest.raises(ValueError, match="strength"):
        timesteps_for_strength(4, 1.5)


def test_solver_protocol_is_step() -> None:
    _, (sigmas, _), _ = setup("sd3", 4)
    x, out = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    solver = FlowMatchEuler()
    assert solver.new_state() is None
    assert_same(solver.step(out, x, sigmas, 1, None), step(out, x, sigmas, 1))
