"""Two-GPU checks (skipped with fewer than two CUDA devices): the packaged `qwen3_omni_2gpu`
graph puts the thinker on GPU 0 and the talker and code2wav on GPU 1, the tensors crossing
between the stage processes through shared memory; its text and speech equal the single-GPU
default graph's, float32 with TF32 off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage import Omni, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

CHAT = [{"role": "user", "content": "Hello world, what is the weather today?"}]


def test_qwen3_omni_on_two_gpus_equals_one(tmp_path: Path) -> None:
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    ckpt = build_tiny_qwen3_omni(tmp_path / "omni")
    params = [SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=40), None]
    results, devices = {}, {}
    for graph in ("qwen3_omni", "qwen3_omni_2gpu"):
        with Omni(str(ckpt), stage_config=graph, device="cuda", dtype="float32") as omni:
            (out,) = omni.generate({"messages": CHAT}, params)
            devices[graph] = {name: info.device for name, info in
                              omni.engine.orchestrator.stage_info.items()}
        assert out.error is None, out.error
        results[graph] = out
    assert devices["qwen3_omni_2gpu"]["thinker"] == "cuda:0"
    assert devices["qwen3_omni_2gpu"]["talker"] == "cuda:1"
    one, two = results["qwen3_omni"], results["qwen3_omni_2gpu"]
    assert two.token_ids == one.token_ids
    a, b = two.tensors["audio"], one.tensors["audio"]
    assert a.shape == b.shape and a.numel() > 0
    assert (a - b).abs().max() <= 1e-3
