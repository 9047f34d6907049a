"""GPU-only (skipped without CUDA): Qwen-Image's and FLUX.1's transformers in bfloat16 with the
fused DiT kernels (layers/dit.py: adaptive norms, gated residuals, q/k norm + rope) against
their PyTorch path, and their forward replayed from a CUDA graph (ShapeGraphs, as a stage's
cuda_graphs) equal to eager: the kernels take no host sync. Head size 128, as the real models.
Float32 against diffusers on CUDA is tests/gpu/test_pipelines_cuda.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from omnistage.benchmarks.common import seeded_init
from omnistage.layers import fused
from omnistage.layers.graph_capture import ShapeGraphs
from omnistage.models.flux_transformer import FluxTransformer2DModel, FluxTransformerConfig
from omnistage.models.qwen_image_transformer import (QwenImageTransformer2DModel,
                                                     QwenImageTransformerConfig)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")


def _randn(*shape: int, gen: torch.Generator) -> Tensor:
    return torch.randn(*shape, generator=gen).to(DEV, torch.bfloat16)


def _qwen_image() -> tuple[nn.Module, Callable[..., Tensor], tuple]:
    with torch.device(DEV):
        model = QwenImageTransformer2DModel(QwenImageTransformerConfig(
            num_layers=2, num_attention_heads=2, joint_attention_dim=64)).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    args = (_randn(2, 16 * 24, 64, gen=gen), _randn(2, 32, 64, gen=gen),
            torch.ones(2, 32, dtype=torch.bool, device=DEV), torch.tensor([0.9, 0.3], device=DEV))
    return model, lambda *a: model(*a, img_shapes=[[(1, 16, 24)]] * 2), args


def _flux() -> tuple[nn.Module, Callable[..., Tensor], tuple]:
    with torch.device(DEV):
        model = FluxTransformer2DModel(FluxTransformerConfig(
            num_layers=1, num_single_layers=2, num_attention_heads=2, joint_attention_dim=64,
            pooled_projection_dim=64)).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(16.0),
                                         torch.arange(24.0), indexing="ij"), -1)
    args = (_randn(2, 16 * 24, 64, gen=gen), _randn(2, 32, 64, gen=gen),
            _randn(2, 64, gen=gen), torch.tensor([0.9, 0.3], device=DEV),
            img_ids.reshape(-1, 3).to(DEV), torch.zeros(32, 3, device=DEV))
    return model, model, args


@pytest.fixture(scope="module", params=["qwen_image", "flux"])
def case(request: pytest.FixtureRequest):
    model, run, args = {"qwen_image": _qwen_image, "flux": _flux}[request.param]()
    seeded_init(model)
    return model.eval(), run, args


def test_fused_near_pytorch_path(case) -> None:
    _, run, args = case
    with torch.inference_mode():
        fused.set_enabled(False)
        try:
            want = run(*args).float()
        finally:
            fused.set_enabled(True)
        got = run(*args).float()
    assert want.abs().max() > 0.5
    assert (got - want).norm() / want.norm() < 2e-2    # bf16: the kernels round less often


def test_cuda_graph_replay_equals_eager(case) -> None:
    _, run, args = case
    graphs = ShapeGraphs(run, capture_after=1)
    with torch.inference_mode():
        eager = run(*args)
        first = graphs(*args)                       # captured, then replayed
        again = graphs(*[a.clone() for a in args])
    assert graphs.num_replays == 2
    for out in (first, again):
        torch.testing.assert_close(out, eager, atol=1e-2, rtol=1e-2)
