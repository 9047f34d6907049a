"""LoRA on Qwen-Image in our engine against diffusers' `load_lora_weights` + `set_adapters`
on a tiny random pipeline (float32): an adapter on every linear of the transformer's blocks
(diffusers' layout), with and without true CFG (the negative branch takes the adapter too),
changing the latents noticeably; a step holding [adapter, none] equal to each alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion_params import LoraRequest
from omnistage.registry import load_component
from omnistage.testing.diffusion import run_alone, run_recording_latents
from tests.golden.diffusion.test_qwen_image_pipeline import NEGATIVE, PROMPT, SIZE, build_reference
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

RANK = 3
MIN_LORA_EFFECT = 0.05


def adapter(path: Path, transformer: torch.nn.Module) -> Path:
    """Random (A, B) on every linear of the blocks, diffusers' names; scaling 1."""
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for name, m in transformer.named_modules():
        if name.startswith("transformer_blocks.") and isinstance(m, torch.nn.Linear):
            tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(
                RANK, m.in_features, generator=g) * 0.3
            tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(
                m.out_features, RANK, generator=g) * 0.3
    file = path / "qwen_lora.safetensors"
    save_file(tensors, str(file))
    return file


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("qwen_image_lora")
    ref = build_reference(path)
    ours = load_component("diffusion", "qwen_image").from_pretrained(
        path, "qwen_image", torch.device("cpu"), torch.float32)
    return ref, ours, adapter(path, ref.transformer)


def _params(seed: int, lora: LoraRequest | None, cfg: bool) -> DiffusionParams:
    return DiffusionParams(height=SIZE, width=SIZE, num_inference_steps=3, seed=seed,
                           true_cfg_scale=4.0 if cfg else 1.0,
                           negative_prompt=NEGATIVE if cfg else None, lora=lora)


@pytest.mark.parametrize("cfg", [False, True], ids=["plain", "true-cfg"])
def test_matches_diffusers(setup, cfg: bool) -> None:
    ref, ours, file = setup
    params = _params(0, LoraRequest("q", str(file), 0.8), cfg)
    ref.load_lora_weights(str(file), adapter_name="q")
    try:
        ref.set_adapters(["q"], [0.8])
        expected = golden.reference(ref, PROMPT, params, "latent")
    finally:
        ref.delete_adapters("q")
    base, _ = run_alone(ours, PROMPT, _params(0, None, cfg))
    assert (expected - base).abs().mean() > MIN_LORA_EFFECT, "the adapter changes nothing"
    got, _ = run_alone(ours, PROMPT, params)
    golden.assert_latents_match(got, expected)


def test_adapter_and_none_in_one_step(setup) -> None:
    _, ours, file = setup
    jobs = {"lora": _params(1, LoraRequest("q", str(file), 0.8), True),
            "none": _params(2, None, True)}

    def drive(engine):
        for rid, p in jobs.items():
            engine.add_request(rid, PROMPT, p)
        return jobs

    runs, _ = run_recording_latents(ours, drive)
    for rid, p in jobs.items():
        alone, _ = run_alone(ours, PROMPT, p)
        torch.testing.assert_close(runs[rid][0], alone, atol=1e-5, rtol=0)
