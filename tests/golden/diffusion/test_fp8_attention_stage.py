"""`quantization: {attention: fp8}` end to end on CPU: a tiny Qwen-Image (2 heads of 64)
served by a DiffusionStage whose DiT attention runs the FP8 emulation (layers/fp8_attention.py,
the CPU path: the kernel's quantization of Q and K, then float32 attention), compared with the
same stage in float32 SDPA: the DiT's forward and the final latents of several requests
(captions of different lengths: padded text keys masked; CFG) close by PSNR, yet not equal
(the fp8 path ran). The kernel itself: tests/golden/layers/test_fp8_attention.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from omnistage.configs.schema import DiffusionSettings, StageConfig, StageInput
from omnistage.diffusion.params import DiffusionParams
from omnistage.payloads import Payload
from omnistage.stages.adapters import StageFeed
from omnistage.stages.diffusion import DiffusionStage
from omnistage.stages.interface import StageRequest
from omnistage.testing.diffusion_ranks import CASES, build_tiny_qwen_image, captions, case_params

pytest.importorskip("diffusers")

RUN = CASES[:4]            # batched: CFG and not, captions of 3-9 tokens, two sizes


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Peak signal-to-noise ratio of x against ref in dB, the peak being ref's range."""
    mse = (x.float() - ref.float()).pow(2).mean()
    return float(10 * torch.log10((ref.max() - ref.min()).float() ** 2 / mse))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen_image(tmp_path_factory.mktemp("qwen_image_d64"), head_dim=64)


def stage_of(folder: Path, quantization: str | None) -> DiffusionStage:
    return DiffusionStage(StageConfig(
        name="dit", kind="diffusion", component="qwen_image", model=str(folder),
        dtype="float32", inputs=(StageInput("encoder", "text"),),
        diffusion=DiffusionSettings(quantization=quantization)), None, "cpu")


def final_latents(stage: DiffusionStage) -> dict[str, torch.Tensor]:
    """RUN's requests batched through the stage -> request id -> final latents."""
    latents: dict[int, torch.Tensor] = {}

    def decode(x: torch.Tensor, params: DiffusionParams) -> torch.Tensor:
        latents[params.seed] = x.clone()
        return torch.zeros(1, 1, 1, 3)

    stage.engine.pipeline.decode = decode
    for case in RUN:
        stage.add(StageRequest(case["id"], time.time(), diffusion=case_params(case),
                               streamed=True))
        stage.feed(case["id"], StageFeed(payload=Payload.unpack(captions(case))))
    deadline = time.monotonic() + 120
    while stage.has_unfinished_requests:
        assert time.monotonic() < deadline, "the stage did not finish in 120 s"
        assert all(r.error is None for r in stage.step())
    return {c["id"]: latents[c["seed"]] for c in RUN}


def test_fp8_attention_stage_close_to_sdpa(folder: Path) -> None:
    exact, fp8 = stage_of(folder, None), stage_of(folder, "attention=fp8")
    assert str(fp8.engine.pipeline.transformer.seq_ranks.attention) == "fp8"
    assert exact.engine.pipeline.transformer.seq_ranks.attention == "sdpa"
    want, got = final_latents(exact), final_latents(fp8)
    for rid in want:
        # measured 46-57 dB; a softmax scale off by 1.3x gives 28-33, the padding mask
        # dropped 27 (on the requests with padded captions)
        assert psnr(got[rid], want[rid]) > 40, (rid, psnr(got[rid], want[rid]))
        assert not torch.equal(got[rid], want[rid]), rid


def test_dit_forward_close_to_sdpa(folder: Path) -> None:
    """One forward of the transformer with a padded caption (key mask) in both stages."""
    models = [stage_of(folder, q).engine.pipeline.transformer for q in (None, "attention=fp8")]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 16, generator=g)                    # (B, 4x4 tokens, 4 * C)
    txt = torch.randn(2, 9, 16, generator=g)
    mask = torch.arange(9)[None, :] < torch.tensor([[9], [4]])
    with torch.no_grad():
        outs = [m(x, txt, mask, torch.tensor([0.7, 0.3]), [[(1, 4, 4)]] * 2) for m in models]
    assert psnr(outs[1], outs[0]) > 40, psnr(outs[1], outs[0])
    assert not torch.equal(outs[1], outs[0])
