"""GPU-only (skipped without CUDA): the MoE experts' grouped-GEMM path (bf16, Hopper) equals
the per-expert loop, and needs no host synchronisation (it can be captured in a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.qwen3_omni.moe import FusedExperts, _use_grouped_mm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_grouped_experts_equal_the_loop(num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    experts = FusedExperts(16, 256, 128).cuda().to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    x = torch.randn(num_tokens, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(16, device="cuda")[:4] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, 4, device="cuda", dtype=torch.bfloat16)
    if not _use_grouped_mm(x):
        pytest.skip("no grouped GEMM on this device")
    with torch.no_grad():
        grouped = experts(x, ids, weights)
        order = ids.flatten().argsort(stable=True)
        xs = x[order // 4]
        looped = experts._looped(xs, ids.flatten())
        looped = torch.zeros_like(x).index_add_(0, order // 4,
                                                looped * weights.flatten()[order, None])
    err = (grouped.float() - looped.float()).norm() / looped.float().norm()
    assert err < 2e-2, err


def test_grouped_experts_capture_in_a_cuda_graph() -> None:
    torch.manual_seed(0)
    experts = FusedExperts(16, 256, 128).cuda().to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    if not _use_grouped_mm(x):
        pytest.skip("no grouped GEMM on this device")
    ids = torch.randint(0, 16, (8, 4), device="cuda")
    weights = torch.rand(8, 4, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = experts(x, ids, weights)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            experts(x, ids, weights)                        # warm-up on a side stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts(x, ids, weights)
        graph.replay()
    torch.cuda.synchronize()
    # index_add_ accumulates with atomics: the replay may round differently in the last bit
    assert torch.isfinite(out).all()
    err = (out.float() - expected.float()).norm() / expected.float().norm()
    assert err < 1e-2, err
