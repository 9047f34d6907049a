"""GPU-only (skipped without CUDA): flow UniPC on CUDA latents equals diffusers' scheduler on the
same device bit for bit, as Wan runs it: float32 latents with bfloat16 transformer outputs, the
schedule on the CPU, the coefficients on the GPU. CUDA rounds a float32 0-dim tensor against
bfloat16 differently from the CPU, so the CPU golden test does not cover this."""

from __future__ import annotations

import pytest
import torch

from omnistage.diffusion.solvers.unipc_flow import (
    UniPCConfig,
    UniPCState,
    make_sigmas,
    step,
)

diffusers = pytest.importorskip("diffusers")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WAN = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0,
       "solver_order": 2, "solver_type": "bh2", "lower_order_final": True,
       "final_sigmas_type": "zero", "num_train_timesteps": 1000}


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift,n", [(3.0, 1), (3.0, 4), (5.0, 10), (3.0, 50)])
def test_step_for_step_on_cuda(shift: float, n: int, out_dtype: torch.dtype) -> None:
    raw = {**WAN, "flow_shift": shift}
    cfg = UniPCConfig.from_dict(raw)
    ref = diffusers.UniPCMultistepScheduler.from_config(raw)
    ref.set_timesteps(n, device="cuda")
    sigmas, timesteps = make_sigmas(cfg, n)
    assert torch.equal(timesteps.cuda(), ref.timesteps)
    g = torch.Generator(device="cuda").manual_seed(n)
    x = expected = torch.randn(2, 16, 3, 30, 52, device="cuda", generator=g)
    state = UniPCState()
    for i, t in enumerate(ref.timesteps):
        out = (torch.randn(x.shape, device="cuda", generator=g) * 1.4).to(out_dtype)
        expected = ref.step(out, t, expected).prev_sample
        x = step(cfg, out, x, sigmas, i, state)
        assert torch.equal(x, expected), (i, (x - expected).abs().max())
