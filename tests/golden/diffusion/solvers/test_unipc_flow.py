"""Golden tests: flow-prediction UniPC vs diffusers' UniPCMultistepScheduler, bit for bit.

Each case is a scheduler_config.json as a Wan checkpoint ships it (or one field away from it);
each run feeds both sides the same model outputs, as a Wan pipeline does: float32 latents with
bfloat16 transformer outputs, or everything in one dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import Tensor

from omnistage.diffusion.solvers.unipc_flow import (
    FlowUniPC,
    UniPCConfig,
    UniPCState,
    make_sigmas,
    step,
    step_batch,
)

diffusers = pytest.importorskip("diffusers")
UniPCMultistepScheduler = diffusers.UniPCMultistepScheduler

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json
WAN = {"_class_name": "UniPCMultistepScheduler", "_diffusers_version": "0.33.0.dev0",
       "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001,
       "disable_corrector": [], "dynamic_thresholding_ratio": 0.995, "final_sigmas_type": "zero",
       "flow_shift": 3.0, "lower_order_final": True, "num_train_timesteps": 1000,
       "predict_x0": True, "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False,
       "sample_max_value": 1.0, "solver_order": 2, "solver_p": None, "solver_type": "bh2",
       "steps_offset": 0, "thresholding": False, "timestep_spacing": "linspace",
       "trained_betas": None, "use_beta_sigmas": False, "use_exponential_sigmas": False,
       "use_flow_sigmas": True, "use_karras_sigmas": False}

CASES: dict[str, dict] = {
    "wan-480p": WAN,
    "wan-720p": {**WAN, "flow_shift": 5.0},               # also Wan2.2-TI2V-5B
    "shift-12": {**WAN, "flow_shift": 12.0},
    "no-shift": {**WAN, "flow_shift": 1.0},
    "sigma-min": {**WAN, "final_sigmas_type": "sigma_min"},
    "not-lower-final": {**WAN, "lower_order_final": False},
    "bh1": {**WAN, "solver_type": "bh1"},
    "order-1": {**WAN, "solver_order": 1},
    "order-3": {**WAN, "solver_order": 3},
    "no-corrector-1": {**WAN, "disable_corrector": [1]},
}
STEPS = (1, 2, 3, 4, 10, 50)
SHAPE = (2, 4, 3, 4, 4)   # (B, C, F, H, W), a video latent


def reference(name: str, n: int) -> UniPCMultistepScheduler:
    ref = UniPCMultistepScheduler.from_config(CASES[name])
    ref.set_timesteps(n)
    return ref


def assert_same(ours: Tensor, ref: Tensor) -> None:
    assert (ours.dtype, ours.shape) == (ref.dtype, ref.shape), (ours.dtype, ours.shape, ref.dtype)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True)


def inputs(n: int, seed: int, sample_dtype: torch.dtype, out_dtype: torch.dtype,
           rows: int = 2) -> tuple[Tensor, list[Tensor]]:
    """A noise latent and n model outputs at the scale of a flow model's (|v| ~ 1.4)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, *SHAPE[1:], generator=g).to(sample_dtype)
    return x, [torch.randn(rows, *SHAPE[1:], generator=g).to(out_dtype) * 1.4 for _ in range(n)]


def reference_loop(ref: UniPCMultistepScheduler, x: Tensor, outs: list[Tensor]) -> list[Tensor]:
    samples = []
    for t, out in zip(ref.timesteps, outs, strict=True):
        x = ref.step(out, t, x).prev_sample
        samples.append(x)
    return samples


@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("name", list(CASES))
def test_make_sigmas_equals_set_timesteps(name: str, n: int) -> None:
    sigmas, timesteps = make_sigmas(UniPCConfig.from_dict(CASES[name]), n)
    ref = reference(name, n)
    assert sigmas.shape == (n + 1,) and timesteps.shape == (n,)
    assert_same(sigmas, ref.sigmas)
    assert_same(timesteps, ref.timesteps)


DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
          (torch.bfloat16, torch.bfloat16)]   # (latents, model output); Wan: fp32 and bf16


@pytest.mark.parametrize("n", STEPS)
@pytest.mark.parametrize("name", list(CASES))
def test_step_for_step(name: str, n: int) -> None:
    """Every intermediate sample equal, so a wrong corrector or order fails at its own step."""
    cfg = UniPCConfig.from_dict(CASES[name])
    sigmas, _ = make_sigmas(cfg, n)
    for sample_dtype, out_dtype in DTYPES:
        x, outs = inputs(n, seed=n, sample_dtype=sample_dtype, out_dtype=out_dtype)
        expected = reference_loop(reference(name, n), x, outs)
        state = UniPCState()
        for i, out in enumerate(outs):
            x = step(cfg, out, x, sigmas, i, state)
            assert_same(x, expected[i])


def test_final_step_returns_the_x0_prediction() -> None:
    """With final sigma 0 the last (first-order) step lands exactly on x - sigma * v, so a lost
    final step or a wrong final sigma shows."""
    cfg = UniPCConfig.from_dict(WAN)
    sigmas, _ = make_sigmas(cfg, 4)
    x, outs = inputs(4, seed=7, sample_dtype=torch.float32, out_dtype=torch.float32)
    state = UniPCState()
    for i, out in enumerate(outs[:-1]):
        x = step(cfg, out, x, sigmas, i, state)
    last = step(cfg, outs[-1], x, sigmas, 3, state)
    assert_same(last, x - sigmas[3] * outs[-1])   # m_3 is predicted from x_3 before correction
    assert (last - x).abs().mean() > 0.1   # sigma_3 ~ 0.5 here: the step moves x a lot


def test_rows_at_different_steps_and_schedules() -> None:
    """Continuous batching: requests with their own schedules (step counts, shifts, final sigma)
    join at different times and share one batched step while alive; each ends equal to
    diffusers run alone on it. The shift and the final sigma live in the schedule, so one
    config steps them all."""
    cfg = UniPCConfig.from_dict(WAN)
    rows = [("wan-480p", 10, 0), ("wan-720p", 4, 3), ("shift-12", 3, 5), ("sigma-min", 2, 1)]
    reqs = []
    for j, (name, n, join) in enumerate(rows):
        x, outs = inputs(n, seed=10 + j, sample_dtype=torch.float32, out_dtype=torch.bfloat16,
                         rows=1 + j % 2)
        reqs.append({"sigmas": make_sigmas(UniPCConfig.from_dict(CASES[name]), n)[0],
                     "x": x, "outs": outs, "idx": 0, "join": join, "state": UniPCState(),
                     "expected": reference_loop(reference(name, n), x, outs)[-1]})
    clock, step_mix = 0, set()
    while any(r["idx"] < len(r["outs"]) for r in reqs):
        batch = [r for r in reqs if r["join"] <= clock and r["idx"] < len(r["outs"])]
        clock += 1
        step_mix.add(tuple(r["idx"] for r in batch))
        counts = [r["x"].shape[0] for r in batch]
        new = step_batch(cfg, torch.cat([r["outs"][r["idx"]] for r in batch]),
                         torch.cat([r["x"] for r in batch]), counts, [r["sigmas"] for r in batch],
                         [r["idx"] for r in batch], [r["state"] for r in batch])
        for r, x in zip(batch, new.split(counts)):
            r["x"], r["idx"] = x, r["idx"] + 1
    assert (5, 2, 0) in step_mix   # one batch held rows at three different steps
    for r in reqs:
        assert_same(r["x"], r["expected"])


def test_solver_protocol_matches_functions() -> None:
    solver = FlowUniPC(UniPCConfig.from_dict(WAN))
    sigmas, _ = solver.make_sigmas(3)
    x, outs = inputs(3, seed=3, sample_dtype=torch.float32, out_dtype=torch.float32)
    expected = reference_loop(reference("wan-480p", 3), x, outs)[-1]
    state = solver.new_state()
    for i, out in enumerate(outs):
        x = solver.step(out, x, sigmas, i, state)
    assert_same(x, expected)


def test_starts_mid_schedule_like_set_begin_index() -> None:
    """img2img-style: a fresh state at step k is diffusers after set_begin_index(k)."""
    cfg = UniPCConfig.from_dict(WAN)
    sigmas, _ = make_sigmas(cfg, 10)
    x, outs = inputs(6, seed=5, sample_dtype=torch.float32, out_dtype=torch.float32)
    ref = reference("wan-480p", 10)
    ref.set_begin_index(4)
    expected = x
    for t, out in zip(ref.timesteps[4:], outs, strict=True):
        expected = ref.step(out, t, expected).prev_sample
    state = UniPCState()
    for i, out in enumerate(outs, start=4):
        x = step(cfg, out, x, sigmas, i, state)
    assert_same(x, expected)


def test_config_from_json(tmp_path: Path) -> None:
    path = tmp_path / "scheduler_config.json"
    path.write_text(json.dumps({**WAN, "flow_shift": 5.0, "disable_corrector": [0, 2]}))
    assert UniPCConfig.from_json(path) == UniPCConfig(flow_shift=5.0, disable_corrector=(0, 2))


def test_rejects_what_it_cannot_match() -> None:
    for key, value in [("prediction_type", "epsilon"), ("use_flow_sigmas", False),
                       ("predict_x0", False), ("thresholding", True),
                       ("use_karras_sigmas", True), ("use_dynamic_shifting", True),
                       ("shift_terminal", 0.1)]:
        with pytest.raises(NotImplementedError, match=key):
            UniPCConfig.from_dict({**WAN, key: value})
    with pytest.raises(NotImplementedError, match="prediction_type"):
        UniPCConfig.from_dict({"use_flow_sigmas": True})   # diffusers' default is epsilon
    with pytest.raises(ValueError, match="solver_type"):
        UniPCConfig(solver_type="bh3")
    with pytest.raises(ValueError, match="final_sigmas_type"):
        UniPCConfig(final_sigmas_type="one")
    with pytest.raises(ValueError, match="num_inference_steps"):
        make_sigmas(UniPCConfig(), 0)
    sigmas, _ = make_sigmas(UniPCConfig(), 4)
    x = torch.zeros(SHAPE)
    state = UniPCState()
    step(UniPCConfig(), x, x, sigmas, 0, state)
    with pytest.raises(AssertionError):   # a skipped step would mix up the history
        step(UniPCConfig(), x, x, sigmas, 2, state)
