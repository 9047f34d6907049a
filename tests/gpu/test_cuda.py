"""GPU-only checks (skipped without CUDA): the AR engine on CUDA equals transformers, in
process and behind a stage process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage import Omni, SamplingParams
from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, SchedulerConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [list(range(3, 3 + n)) for n in (1, 17, 64, 150)]


def reference(path: Path, prompt: list[int], n: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_engine_on_cuda_matches_transformers(tiny_qwen3: Path) -> None:
    engine = AREngine(ARConfig(model=str(tiny_qwen3), device="cuda", dtype="float32",
                               memory_fraction=0.2,
                               scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    assert engine.kv_layout.num_blocks > 0
    params = SamplingParams(temperature=0, max_tokens=10)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests:
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    for i, p in enumerate(PROMPTS):
        assert got[str(i)] == reference(tiny_qwen3, p, 10)


def test_stage_process_on_cuda(tiny_qwen3: Path) -> None:
    with Omni(str(tiny_qwen3), device="cuda", dtype="float32") as omni:
        outs = omni.generate([{"prompt_token_ids": p} for p in PROMPTS],
                             SamplingParams(temperature=0, max_tokens=10))
    for p, out in zip(PROMPTS, outs):
        assert out.error is None and out.token_ids == reference(tiny_qwen3, p, 10)


def test_demo_model_on_cuda() -> None:
    from omnistage import DiffusionParams

    with Omni(device="cuda") as omni:
        (out,) = omni.generate("a handwritten 5", DiffusionParams(num_images=4, seed=0))
    assert out.error is None and len(out.images) == 4
    assert out.tensors["images"].shape == (4, 64, 64, 1)
