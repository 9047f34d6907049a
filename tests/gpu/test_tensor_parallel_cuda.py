"""Tensor-parallel stages on two GPUs (issue 18; skipped with fewer): one process per rank over
NCCL, decode steps replayed from CUDA graphs that capture the all-reduces and the LM head's
gather, async scheduling on. Float32 with TF32 off: the tokens (and Qwen3-Omni's speech) equal
one GPU's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage import Omni, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

CHAT = [{"role": "user", "content": "Hello world, what is the weather today?"}]


def test_qwen3_over_two_gpus_equals_one(tiny_qwen3: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40, 9)]
    tokens, info = {}, {}
    for tp in (1, 2):
        with Omni(str(tiny_qwen3), device="cuda", dtype="float32",
                  tensor_parallel_size=tp) as omni:
            outs = omni.generate(prompts, params, use_tqdm=False)
            info[tp] = omni.engine.orchestrator.stage_info["llm"]
        assert all(o.error is None for o in outs), [o.error for o in outs]
        tokens[tp] = [o.token_ids for o in outs]
    assert info[2].cuda_graphs, info[2]          # the decodes replayed graphs
    assert tokens[2] == tokens[1]
    assert len(set(map(tuple, tokens[1]))) == len(prompts)


def test_qwen3_omni_thinker_over_two_gpus_equals_one(tmp_path: Path) -> None:
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    ckpt = build_tiny_qwen3_omni(tmp_path / "omni")
    params = [SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=40), None]
    results = {}
    for tp in (1, 2):
        with Omni(str(ckpt), device="cuda", dtype="float32", tensor_parallel_size=tp) as omni:
            (out,) = omni.generate({"messages": CHAT}, params)
            if tp == 2:
                assert len(omni.engine.orchestrator.stages.rank_pids["thinker"]) == 2
        assert out.error is None, out.error
        results[tp] = out
    one, two = results[1], results[2]
    assert two.token_ids == one.token_ids
    a, b = two.tensors["audio"], one.tensors["audio"]
    assert a.shape == b.shape and a.numel() > 0
    assert (a - b).abs().max() <= 1e-3
