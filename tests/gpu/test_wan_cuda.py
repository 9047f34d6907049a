"""GPU-only (skipped without CUDA): the Wan transformer's CUDA paths that the CPU tests cannot
reach, on a small random model in bfloat16 against diffusers' WanTransformer3DModel with the
same weights (head size 128, as the real models, so SDPA's fused kernels take it): near
diffusers, and the forward replayed from a CUDA graph (ShapeGraphs, as a stage's
cuda_graphs) equal to eager (the fused Triton kernels run in both)."""

from __future__ import annotations

import pytest
import torch

from omnistage.benchmarks.common import seeded_init
from omnistage.layers.graph_capture import ShapeGraphs
from omnistage.models.diffusers_loader import keep_in_fp32
from omnistage.models.wan_transformer import WanTransformer3DModel, WanTransformerConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
diffusers = pytest.importorskip("diffusers")

ARCH = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128,
            in_channels=16, out_channels=16, text_dim=64, freq_dim=256, ffn_dim=512,
            num_layers=2)


@pytest.fixture(scope="module")
def models():
    dev = torch.device("cuda")
    with torch.device(dev):
        ref = diffusers.WanTransformer3DModel(**ARCH).to(torch.bfloat16).eval()
        ours = WanTransformer3DModel(WanTransformerConfig.from_dict(ARCH)).to(torch.bfloat16)
    keep_in_fp32(ref, tuple(ref._keep_in_fp32_modules))
    keep_in_fp32(ours)
    seeded_init(ref)
    seeded_init(ours)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 5, 16, 24, generator=gen).to(dev, torch.bfloat16)   # 960 tokens
    text = torch.randn(2, 32, 64, generator=gen).to(dev, torch.bfloat16)
    t = torch.tensor([900, 300], device=dev)
    with torch.inference_mode():
        expected = ref(x, t, text, return_dict=False)[0].float()
    return ours.eval(), (x, t, text), expected


def test_near_diffusers(models) -> None:
    ours, args, expected = models
    assert expected.abs().max() > 0.5
    with torch.inference_mode():
        out = ours(*args).float()
    assert (out - expected).norm() / expected.norm() < 2e-2


def test_cuda_graph_replay_equals_eager(models) -> None:
    ours, args, _ = models
    graphs = ShapeGraphs(ours, capture_after=1)
    with torch.inference_mode():
        eager = ours(*args)
        first = graphs(*args)                       # captured, then replayed
        again = graphs(*[a.clone() for a in args])
    assert graphs.num_replays == 2
    for out in (first, again):        # the same kernels; bf16 noise at most
        torch.testing.assert_close(out, eager, atol=1e-2, rtol=1e-2)
