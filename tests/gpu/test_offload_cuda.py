"""Layerwise offload on CUDA (diffusion/offload.py): blocks in pinned host memory, copied on
a side stream into device slots while the block before computes; the outputs equal the
resident model's bit for bit, in order, out of order and over many forwards, with 1 and 2
blocks fetched ahead."""

from __future__ import annotations

import pytest
import torch

from omnistage.diffusion.offload import BlockOffload

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class Stack(torch.nn.Module):
    def __init__(self, width: int = 1024, depth: int = 6) -> None:
        super().__init__()
        self.head = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                torch.nn.Linear(4 * width, width)) for _ in range(depth))

    def forward(self, x: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
        x = self.head(x)
        for i in order if order is not None else range(len(self.blocks)):
            x = x + self.blocks[i](x)
        return x


@pytest.mark.parametrize("prefetch", [1, 2])
def test_offloaded_stack_equals_resident(prefetch: int) -> None:
    torch.manual_seed(0)
    host = Stack().to(torch.bfloat16)
    resident = Stack().to(torch.bfloat16)
    resident.load_state_dict(host.state_dict())
    resident.cuda()
    offload = BlockOffload(host, torch.device("cuda"), prefetch)
    assert host.head.weight.is_cuda and not host.blocks[0][0].weight.is_cuda
    assert host.blocks[0][0].weight.is_pinned()
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for order in (None, None, [5, 0, 3], None, [2, 2, 1]):
            torch.testing.assert_close(host(x, order), resident(x, order), atol=0, rtol=0)
    torch.cuda.synchronize()
    assert offload.num_loads > offload.num_late_loads > 0
    block = sum(p.numel() * 2 for p in resident.blocks[0].parameters())
    assert offload.resident_bytes == (prefetch + 1) * block
