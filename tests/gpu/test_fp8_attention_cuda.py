"""GPU-only (skipped without an FP8 GPU, compute capability 8.9+): the FP8 attention kernel
(layers/fp8_attention.py) compiled for the device, with bf16 V and output (which the CPU
interpreter cannot run): against its emulation and float32 SDPA at odd lengths, head dims 64,
128 and 256, key masks, Qwen-Image's 1024 px shape; the Triton quantization pass equal to the
PyTorch form bit for bit; strided (B, S, H, D) inputs as the DiTs pass them; eager,
torch.compile'd and CUDA-graphed calls agree; every tile of the benchmark's sweep gives the
same answer; a tiny Qwen-Image stage with `attention: fp8` runs the kernel and stays close to
its bf16 twin."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from omnistage.layers import fp8_attention as fa
from omnistage.layers.sequence_parallel import sdpa

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with FP8 tensor cores")]

BF16 = torch.bfloat16


def make_qkv(b: int, h: int, len_q: int, len_k: int, d: int, seed: int = 0
             ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, len_q, d, device="cuda", generator=gen)
    k = torch.randn(b, h, len_k, d, device="cuda", generator=gen)
    k = (k + torch.randn(1, h, 1, d, device="cuda", generator=gen)) * torch.linspace(
        0.5, 2.0, len_k, device="cuda")[:, None]
    v = torch.randn(b, h, len_k, d, device="cuda", generator=gen)
    return q.to(BF16), k.to(BF16), v.to(BF16)


def check_close_to_sdpa(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None = None) -> None:
    """Loose, as on CPU (tests/golden/layers/test_fp8_attention.py): e4m3 Q and K's cost."""
    m = None if mask is None else mask[:, None, None, :]
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m)
    err = (out.float() - exact).abs()
    assert err.max() < 0.3 and err.mean() < 0.02, (err.max(), err.mean())
    assert F.cosine_similarity(out.float().flatten(), exact.flatten(), dim=0) > 0.997


@pytest.mark.parametrize("b, h, len_q, len_k, d, masked", [
    (2, 3, 77, 77, 64, False), (2, 4, 333, 333, 128, True), (2, 2, 1030, 1030, 128, False),
    (2, 2, 100, 333, 64, True), (2, 2, 300, 300, 256, True), (1, 24, 4160, 4160, 128, False),
])
def test_kernel_against_emulation_and_sdpa(b: int, h: int, len_q: int, len_k: int, d: int,
                                           masked: bool) -> None:
    q, k, v = make_qkv(b, h, len_q, len_k, d)
    mask = None
    if masked:
        mask = torch.arange(len_k, device="cuda")[None, :] < torch.tensor(
            [[len_k - 5], [len_k // 3]], device="cuda")
    out = fa.fp8_attention(q, k, v, mask)
    assert out.dtype == BF16 and out.shape == (b, h, len_q, d)
    emulated = fa.fp8_attention_reference(q, k, v, mask)
    # tight up to bf16: P rounded to bf16 in the kernel, both outputs rounded to bf16
    err = (out.float() - emulated.float()).abs()
    assert err.max() < 0.03 and err.mean() < 2e-3, (err.max(), err.mean())
    check_close_to_sdpa(out, q, k, v, mask)


def test_quantize_pass_equals_the_pytorch_form() -> None:
    """The Triton quantization pass writes exactly the e4m3 values of the PyTorch form (the
    CPU path, and what the emulation reads), strided input and smoothing included."""
    q, k, _ = make_qkv(2, 3, 1030, 1030, 128, seed=3)
    k = k.transpose(1, 2).contiguous().transpose(1, 2)              # (B, S, H, D) memory
    mean = k.mean(dim=2, keepdim=True, dtype=torch.float32)
    for x, m in ((q, None), (k, mean)):
        x8, scale = fa.quantize_heads(x, m)
        y = x.float() if m is None else x.float() - m
        want = (y / scale[:, :, None, None]).clamp(-fa.FP8_MAX, fa.FP8_MAX).to(fa.FP8)
        assert torch.equal(x8.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_strided_compiled_and_graphed() -> None:
    """(B, S, H, D) as the DiTs hold them through sequence_parallel.sdpa: eager, compiled
    (an opaque op to inductor; the quantization step fused) and replayed from a CUDA graph."""
    q, k, v = (t.transpose(1, 2).contiguous() for t in make_qkv(2, 4, 333, 333, 128, seed=1))
    mask = torch.ones(2, 333, dtype=torch.bool, device="cuda")
    mask[1, 200:] = False
    eager = sdpa(q, k, v, mask, "fp8")
    plain = fa.fp8_attention(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), mask)
    torch.testing.assert_close(eager, plain.transpose(1, 2), atol=1e-2, rtol=0)
    compiled = torch.compile(lambda a, b_, c, m: sdpa(a, b_, c, m, "fp8"), dynamic=True)
    torch.testing.assert_close(compiled(q, k, v, mask), eager, atol=2e-2, rtol=0)
    static = [t.clone() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    sdpa(*static, mask, "fp8")                                     # built before capture
    with torch.cuda.graph(graph):
        out = sdpa(*static, mask, "fp8")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_every_swept_tile_agrees() -> None:
    from omnistage.benchmarks.kernels.fp8_attention import DEFAULT_TILES

    q, k, v = make_qkv(1, 4, 1030, 1030, 128, seed=2)
    want = fa.fp8_attention_reference(q, k, v)
    for text in DEFAULT_TILES.split(";"):
        out = fa.fp8_attention(q, k, v, tiles=fa.Tiles.parse(text))
        err = (out.float() - want.float()).abs()
        assert err.max() < 0.03, (text, err.max())


def test_qwen_image_stage_runs_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    from omnistage.configs.schema import DiffusionSettings, StageConfig, StageInput
    from omnistage.payloads import Payload
    from omnistage.stages.adapters import StageFeed
    from omnistage.stages.diffusion import DiffusionStage
    from omnistage.stages.interface import StageRequest
    from omnistage.testing.diffusion_ranks import (CASES, build_tiny_qwen_image, captions,
                                                   case_params)

    pytest.importorskip("diffusers")
    folder = build_tiny_qwen_image(tmp_path / "qwen_image", head_dim=64)
    launches = []
    launch = fa.launch
    monkeypatch.setattr(fa, "launch", lambda *a: launches.append(1) or launch(*a))

    def run(quantization: str | None) -> dict[str, torch.Tensor]:
        stage = DiffusionStage(StageConfig(
            name="dit", kind="diffusion", component="qwen_image", model=str(folder),
            dtype="bfloat16", inputs=(StageInput("encoder", "text"),),
            diffusion=DiffusionSettings(quantization=quantization)), None, "cuda")
        latents: dict[int, torch.Tensor] = {}

        def decode(x: torch.Tensor, params) -> torch.Tensor:  # type: ignore[no-untyped-def]
            latents[params.seed] = x.float().cpu()
            return torch.zeros(1, 1, 1, 3)

        stage.engine.pipeline.decode = decode
        for case in CASES[:3]:
            stage.add(StageRequest(case["id"], time.time(), diffusion=case_params(case),
                                   streamed=True))
            stage.feed(case["id"], StageFeed(payload=Payload.unpack(captions(case))))
        deadline = time.monotonic() + 300
        while stage.has_unfinished_requests:
            assert time.monotonic() < deadline
            assert all(r.error is None for r in stage.step())
        return latents

    want = run(None)
    assert not launches
    got = run("attention=fp8")
    assert launches                                 # the kernel, not the emulation
    for seed, ref in want.items():
        mse = (got[seed] - ref).pow(2).mean()
        psnr = 10 * torch.log10((ref.max() - ref.min()) ** 2 / mse)
        assert psnr > 30, (seed, psnr)
