"""Greedy tokens of a quantized AR stage against float32 on the tiny Qwen3 and the tiny
Qwen3-Omni thinker (CPU): `int8`
through the engine's own hook (ARConfig.quantization), `fp8` (load-time, torch's CPU
`_scaled_mm`) and the same weights shipped as a compressed-tensors FP8 checkpoint. Two rates,
docs/quantization.md reports both: top-1 agreement, the share of float32's greedy tokens that
the quantized model also ranks first when fed float32's stream (teacher forcing), and the
greedy prefix, the share of each request's own greedy tokens before its first difference from
float32's (a greedy stream that differs once goes its own way)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.ar.quantize import quantize_model
from omnistage.configs.quantization import ComponentQuantization
from omnistage.configs.schema import ARConfig
from omnistage.layers.fp8 import Fp8Linear
from omnistage.layers.int8 import Int8Linear
from omnistage.models.loader import load_model
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_models import PagedCache
from tests.helpers.compressed_tensors import write_fp8_checkpoint

MAX_TOKENS = 24
PROMPT_LENS = (3, 17, 40, 99)


def greedy(engine: AREngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """Mean share of tokens before the first difference."""
    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
    return sum(prefix(g, w) / len(w) for g, w in zip(got, want)) / len(want)


def top1(model: torch.nn.Module, prompts: list[list[int]], want: list[list[int]]) -> float:
    """Share of `want`'s tokens that `model` ranks first given the prompt and `want` before."""
    rows = [(i, torch.tensor(p + w[:-1])) for i, (p, w) in enumerate(zip(prompts, want))]
    hidden, _ = PagedCache(model, num_blocks=128).run(model, rows)
    hits = total = 0
    for h, p, w in zip(hidden, prompts, want):
        with torch.no_grad():
            ranked = model.compute_logits(h[len(p) - 1:]).argmax(-1)
        hits += int((ranked == torch.tensor(w)).sum())
        total += len(w)
    return hits / total


def fp8_loader(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    model, cfg, hf = load_model(path, device, dtype)
    quantize_model(model, ComponentQuantization("fp8"), device, allow_cpu=True)
    return model, cfg, hf


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(400) for _ in range(n)] for n in PROMPT_LENS]


def engine(path: Path, quantization: str | None = None, loader=None) -> AREngine:
    q = ComponentQuantization(quantization) if quantization else None
    return AREngine(ARConfig(model=str(path), device="cpu", dtype="float32", quantization=q),
                    loader=loader)


def test_tokens_agree_with_float32(tiny_qwen3: Path, prompts: list[list[int]],
                                   tmp_path: Path) -> None:
    want = greedy(engine(tiny_qwen3), prompts)
    int8 = engine(tiny_qwen3, "int8")
    assert sum(isinstance(m, Int8Linear) for m in int8.model.modules()) == 2 * 4
    fp8 = engine(tiny_qwen3, loader=fp8_loader)
    shipped = engine(write_fp8_checkpoint(tiny_qwen3, tmp_path / "fp8"))
    assert sum(isinstance(m, Fp8Linear) for m in shipped.model.modules()) == 2 * 4
    engines = {"int8": int8, "fp8": fp8, "fp8 checkpoint": shipped}
    prefix = {name: agreement(greedy(e, prompts), want) for name, e in engines.items()}
    ranked = {name: top1(e.model, prompts, want) for name, e in engines.items()}
    print("greedy prefix share:", prefix, "top-1 agreement:", ranked)
    assert prefix["fp8 checkpoint"] == prefix["fp8"]       # the same weights, the same tokens
    assert ranked["fp8 checkpoint"] == ranked["fp8"]
    assert ranked["int8"] >= 0.95 and ranked["fp8"] >= 0.85, ranked
    assert prefix["int8"] >= 0.8, prefix


def test_qwen3_omni_thinker_tokens(tmp_path_factory: pytest.TempPathFactory,
                                   prompts: list[list[int]]) -> None:
    """The tiny Qwen3-Omni thinker (M-RoPE, MoE in every layer: only attention's linears are
    linears) through the engine with int8, and load-time fp8, against float32."""
    from omnistage.models.qwen3_omni.thinker import Qwen3OmniThinkerForCausalLM
    from omnistage.stages.talker import load_component
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    path = build_tiny_qwen3_omni(tmp_path_factory.mktemp("omni") / "omni", with_processor=False)
    load = load_component(Qwen3OmniThinkerForCausalLM)

    def fp8(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
        model, cfg, hf = load(path, device, dtype)
        quantize_model(model, ComponentQuantization("fp8"), device, allow_cpu=True)
        return model, cfg, hf

    want = greedy(engine(path, loader=load), prompts)
    engines = {"int8": engine(path, "int8", loader=load), "fp8": engine(path, loader=fp8)}
    assert sum(isinstance(m, Int8Linear) for m in engines["int8"].model.modules()) == 3 * 2
    prefix = {name: agreement(greedy(e, prompts), want) for name, e in engines.items()}
    ranked = {name: top1(e.model, prompts, want) for name, e in engines.items()}
    print("thinker: greedy prefix share:", prefix, "top-1 agreement:", ranked)
    assert ranked["int8"] >= 0.9 and ranked["fp8"] >= 0.85, ranked


def test_fp8_needs_fp8_matmuls(tiny_qwen3: Path) -> None:
    with pytest.raises(ValueError, match="quantization fp8 runs on CUDA GPUs of compute "
                                         "capability 8.9 or newer; this model is on cpu"):
        engine(tiny_qwen3, "fp8")
