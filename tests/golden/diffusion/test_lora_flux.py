"""LoRA on FLUX.1 in our engine against diffusers' `load_lora_weights` + `set_adapters` on a
tiny random pipeline (float32): a PEFT-layout adapter (with lora_alpha in its metadata) and a
kohya-layout one (fused qkv split, alpha), each changing the latents noticeably; a batch of
[lora A, none, lora B] equal to each request alone; bad adapters refused naming the field;
unloading frees the adapter's tensors."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion_params import LoraRequest
from omnistage.errors import InputError
from omnistage.testing.diffusion import run_alone, run_recording_latents
from tests.golden.diffusion.test_flux_pipeline import PROMPT, SEQ, SIZE, build_reference
from tests.helpers import diffusion_golden as golden

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

RANK = 4
PEFT_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff_context.net.2",
                "norm1.linear")
SINGLE_TARGETS = ("attn.to_q", "attn.to_v", "proj_mlp", "proj_out")
KOHYA = {"double_blocks_0_img_attn_qkv": 96, "double_blocks_0_txt_attn_qkv": 96,
         "double_blocks_0_img_mlp_0": 128, "double_blocks_0_txt_attn_proj": 32,
         "single_blocks_0_linear2": 32, "single_blocks_0_modulation_lin": 96}
MIN_LORA_EFFECT = 0.05      # mean |latents with - without|: the adapter must matter


def _pair(g: torch.Generator, n_in: int, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(RANK, n_in, generator=g) * 0.3, torch.randn(n_out, RANK, generator=g) * 0.3)


def peft_adapter(path: Path, transformer: torch.nn.Module, seed: int) -> Path:
    """diffusers' layout (transformer.<module>.lora_A/B.weight), lora_alpha = 2 r."""
    g = torch.Generator().manual_seed(seed)
    modules = dict(transformer.named_modules())
    names = [f"transformer_blocks.0.{t}" for t in PEFT_TARGETS] + [
        f"single_transformer_blocks.0.{t}" for t in SINGLE_TARGETS]
    tensors = {}
    for name in names:
        a, b = _pair(g, modules[name].in_features, modules[name].out_features)
        tensors[f"transformer.{name}.lora_A.weight"] = a
        tensors[f"transformer.{name}.lora_B.weight"] = b
    meta = {"transformer.r": RANK, "transformer.lora_alpha": 2 * RANK,
            "transformer.target_modules": names}
    file = path / f"peft{seed}.safetensors"
    save_file(tensors, str(file), metadata={"format": "pt",
                                             "lora_adapter_metadata": json.dumps(meta)})
    return file


def kohya_adapter(path: Path, seed: int) -> Path:
    """kohya's FLUX.1 layout: lora_down / lora_up / alpha on the original (fused) names."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, n_out in KOHYA.items():
        n_in = 160 if name.endswith("linear2") else 32        # linear2 reads [attn | mlp]
        a, b = _pair(g, n_in, n_out)
        tensors[f"lora_unet_{name}.lora_down.weight"] = a
        tensors[f"lora_unet_{name}.lora_up.weight"] = b
        tensors[f"lora_unet_{name}.alpha"] = torch.tensor(float(RANK) / 2)
    file = path / f"kohya{seed}.safetensors"
    save_file(tensors, str(file))
    return file


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("flux_lora")
    ref = build_reference(path, guidance_embeds=True)
    ours = golden.load_ours(path, "flux")
    ours.prompt_encoder.max_sequence_length = SEQ
    files = {"a": peft_adapter(path, ref.transformer, 1), "b": kohya_adapter(path, 2)}
    return ref, ours, files


def _params(seed: int, lora: LoraRequest | None = None, n: int = 1) -> DiffusionParams:
    return DiffusionParams(height=SIZE, width=SIZE + 16, num_inference_steps=3,
                           guidance_scale=3.5, seed=seed, num_images=n, lora=lora)


def _reference(ref, params: DiffusionParams, file: Path, name: str) -> torch.Tensor:
    ref.load_lora_weights(str(file), adapter_name=name)
    try:
        ref.set_adapters([name], [params.lora.scale])
        return golden.reference(ref, PROMPT, params, "latent", max_sequence_length=SEQ)
    finally:
        ref.delete_adapters(name)


@pytest.mark.parametrize("name,scale", [("a", 0.7), ("b", 1.3)])
def test_matches_diffusers(setup, name: str, scale: float) -> None:
    ref, ours, files = setup
    params = _params(0, LoraRequest(name, str(files[name]), scale), n=2)
    expected = _reference(ref, params, files[name], name)
    base, _ = run_alone(ours, PROMPT, _params(0, None, n=2))
    assert (expected - base).abs().mean() > MIN_LORA_EFFECT, "the adapter changes nothing"
    got, _ = run_alone(ours, PROMPT, params)
    golden.assert_latents_match(got, expected)


def test_batch_of_adapters_equals_each_alone(setup) -> None:
    _, ours, files = setup
    jobs = {"a": _params(3, LoraRequest("a", str(files["a"]), 0.7)),
            "none": _params(4),
            "b": _params(5, LoraRequest("b", str(files["b"]), 1.3), n=2),
            "a2": _params(6, LoraRequest("a", str(files["a"]), 0.7))}

    def drive(engine: DiffusionEngine) -> dict[str, DiffusionParams]:
        for rid, p in jobs.items():
            engine.add_request(rid, PROMPT, p)
        return jobs

    runs, engine = run_recording_latents(ours, drive)
    assert sorted(engine.lora.names) == ["a", "b"]
    for rid, p in jobs.items():
        alone, _ = run_alone(ours, PROMPT, p)
        torch.testing.assert_close(runs[rid][0], alone, atol=1e-5, rtol=0)


def test_bad_adapters_refused_naming_the_field(setup, tmp_path: Path) -> None:
    _, ours, files = setup
    engine = DiffusionEngine(ours)
    cases = [(LoraRequest("nope"), "lora.name"),
             (LoraRequest("x", str(tmp_path / "missing.safetensors")), "lora.path")]
    wrong = tmp_path / "wrong.safetensors"       # a rank-4 pair of the wrong width
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 7),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(32, 4)},
              str(wrong))
    cases.append((LoraRequest("w", str(wrong)), "lora.path"))
    for lora, param in cases:
        with pytest.raises(InputError) as err:
            engine.add_request("bad", PROMPT, _params(0, lora))
        assert err.value.param == param, (str(err.value), param)
    with pytest.raises(InputError) as err:
        LoraRequest("a", scale=float("nan"))
    assert err.value.param == "lora.scale"
    assert not engine.has_unfinished_requests


def test_unload_frees_the_adapter(setup) -> None:
    _, ours, files = setup
    engine = DiffusionEngine(ours)
    engine.add_request("r", PROMPT, _params(0, LoraRequest("a", str(files["a"]))))
    held = weakref.ref(next(iter(engine.lora.adapters["a"].layers.values())).b)
    engine.abort("r")
    assert engine.lora.unload("a") and engine.lora.names == []
    gc.collect()
    assert held() is None, "the adapter's tensors outlive its unloading"
    # by name alone once loaded; the base weights were never touched
    engine.lora.load("a", str(files["a"]))
    engine.add_request("r2", PROMPT, _params(0, LoraRequest("a")))
    assert engine.lora.names == ["a"]
