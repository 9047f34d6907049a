"""GPU-only (skipped without CUDA): the split-K 4-bit matrix-vector kernel
(layers/triton_int4_split.py) compiled, in bfloat16 and float32, at odd shapes and the decode
shapes of Qwen3-0.6B / 1.7B, every split of K, 1 to 4 rows, against the float32 matmul of the
dequantized weight; the same output on every call (no atomics) and inside a CUDA graph (PDL on
Hopper)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omnistage.layers.int4 import dequantize_int4, quantize_int4

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (N, K, G, BLOCK_N, BLOCK_K)
SHAPES = [(37, 100, 32, 8, 32), (24, 1100, 128, 8, 256), (19, 1103, 128, 16, 128),
          (2048, 2048, 128, 64, 256), (1024, 3072, 128, 128, 256), (4096, 1024, 128, 16, 256),
          (70, 600, 128, 64, 256)]


def _case(n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(n + k)
    weight = torch.randn(n, k, device="cuda") * torch.linspace(0.2, 2.0, k, device="cuda")
    return quantize_int4(weight, group, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, group, block_n, block_k", SHAPES)
def test_split_kernel_on_cuda(n: int, k: int, group: int, block_n: int, block_k: int,
                              dtype: torch.dtype) -> None:
    from omnistage.layers import triton_int4_split as ts

    packed, scale = _case(n, k, group)
    w = dequantize_int4(packed, scale.float(), k, group)
    num_tiles = -(-k // max(block_k, group))
    for split in sorted({1, 2, 3, min(8, num_tiles), num_tiles, num_tiles + 2}):
        cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split,
                   num_warps=8 if block_n >= 64 else 4, num_stages=1)
        for rows in (1, 2, 3, 4):
            x = torch.randn(rows, k, device="cuda").to(dtype)
            bias = (torch.randn(n, device="cuda") * 4).to(dtype) if rows % 2 else None
            want = F.linear(x.float(), w, None if bias is None else bias.float())
            got = ts.linear(x, packed, scale, group, bias, cfg)
            assert got.dtype == dtype and got.shape == (rows, n)
            # float32: another order of the same sum; bfloat16: the output rounded once
            rel = 1e-4 if dtype == torch.float32 else 8e-3
            torch.testing.assert_close(got.float(), want, rtol=rel,
                                       atol=rel * float(want.abs().max()))
            assert torch.equal(ts.linear(x, packed, scale, group, bias, cfg), got)


def test_default_tiles_and_graph_replay() -> None:
    """The default tiles (splits of K) at Qwen3-1.7B's down_proj shape, eager and replayed in
    a CUDA graph, equal."""
    from omnistage.layers import triton_int4_split as ts

    n, k, group = 2048, 6144, 128
    packed, scale = _case(n, k, group)
    assert ts.config(n, k, group)["SPLIT_K"] > 1
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    eager = ts.linear(x, packed, scale, group)
    want = F.linear(x.float(), dequantize_int4(packed, scale.float(), k, group))
    torch.testing.assert_close(eager.float(), want, rtol=8e-3,
                               atol=8e-3 * float(want.abs().max()))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ts.linear(x, packed, scale, group)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ts.linear(x, packed, scale, group)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
