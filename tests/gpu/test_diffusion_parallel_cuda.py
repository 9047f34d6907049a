"""Parallel diffusion stages on CUDA (issue 18): the fused attention kernels that return the
log-sum-exp (ring attention's partial results) against the plain formula, and on two GPUs
(NCCL: all-to-all with uneven splits, ring send/recv, all-gathers, the step-cache agreement)
the tiny Qwen-Image's latents under each layout against one GPU, float32 without TF32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.configs.schema import ParallelSizes
from omnistage.layers.groups import StageRanks
from omnistage.layers.sequence_parallel import attention_lse, merge_partial, sdpa
from omnistage.testing.diffusion_ranks import CASES, build_tiny_qwen_image, pipeline_run
from omnistage.testing.ranks import run_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["whole", "masked"])
def test_attention_lse_kernels(dtype: torch.dtype, tol: float, masked: bool) -> None:
    """Flash (half, no mask) or memory-efficient attention (a bias) with their lse equal the
    formula; two key chunks merged by lse equal attention over all keys, also where one
    chunk is wholly masked for a row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 64, generator=g) for n in (37, 50, 50))
    mask = torch.rand(2, 50, generator=g) > 0.3 if masked else None
    if masked:
        mask[1, :25] = False                         # row 1: the first chunk has no key
    out, lse = attention_lse(*(t.cuda().to(dtype) for t in (q, k, v)),
                             None if mask is None else mask.cuda())
    ref_out, ref_lse = attention_lse(q, k, v, mask)  # CPU: the formula, float32
    assert (out.cpu() - ref_out).abs().max() < tol
    assert (lse.cpu() - ref_lse).abs().max() < tol * 10
    merged = lse_ = None
    for part in (slice(0, 25), slice(25, 50)):
        m = None if mask is None else mask[:, part].cuda()
        merged, lse_ = merge_partial(merged, lse_, *attention_lse(
            q.cuda().to(dtype), k[:, part].cuda().to(dtype), v[:, part].cuda().to(dtype), m))
    assert (merged.cpu() - sdpa(q, k, v, mask)).abs().max() < tol


def test_qwen_image_graphs_equal_eager(tmp_path_factory: pytest.TempPathFactory) -> None:
    """One GPU: the forwards replayed from real CUDA graphs (several shapes, batches that
    change as requests join and finish) give the eager run's latents."""
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = str(build_tiny_qwen_image(tmp_path_factory.mktemp("qwen_image")))
    eager = pipeline_run(StageRanks.single(), folder, CASES, device="cuda")
    graphed = pipeline_run(StageRanks.single(), folder, CASES, device="cuda", graphs=True)
    assert graphed["replays"] >= 2
    for rid, ref in eager["latents"].items():
        ref = torch.tensor(ref)
        assert ref.abs().max() > 1.0
        assert (torch.tensor(graphed["latents"][rid]) - ref).abs().max() < 1e-5, rid


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("sizes", [ParallelSizes(cfg=2), ParallelSizes(ulysses=2),
                                   ParallelSizes(ring=2), ParallelSizes(tp=2)],
                         ids=["cfg2", "ulysses2", "ring2", "tp2"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_qwen_image_layouts_on_two_gpus(tmp_path_factory: pytest.TempPathFactory,
                                        sizes: ParallelSizes, graphs: bool, tmp_path: Path
                                        ) -> None:
    """graphs: each rank's forwards replayed from CUDA graphs, the collectives inside them
    captured too."""
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = str(build_tiny_qwen_image(tmp_path_factory.mktemp("qwen_image")))
    reference = pipeline_run(StageRanks.single(), folder, CASES, device="cuda")
    results = run_ranks("omnistage.testing.diffusion_ranks:pipeline_run", sizes,
                        {"folder": folder, "cases": CASES, "device": "cuda",
                         "graphs": graphs}, tmp_path, backend="nccl")
    assert all((r["replays"] > 0) == graphs for r in results)
    for result in results:
        for rid, ref in reference["latents"].items():
            ref = torch.tensor(ref)
            assert ref.abs().max() > 1.0
            assert (torch.tensor(result["latents"][rid]) - ref).abs().max() < 1e-4, rid
    assert results[0]["latents"] == results[1]["latents"]
