"""A checkpoint that ships FP8 weights in compressed-tensors' layout (models/compressed_tensors.py)
loads straight into FP8 linears: the tiny Qwen3 written in that layout (tests/helpers) gives the
logits of our load-time FP8 of the same float weights (per-channel scales: the same e4m3
weights and scales), and per-tensor scales give the layout's own dequantization (q * scale) on
every fused row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.ar.quantize import quantize_model
from omnistage.configs.quantization import ComponentQuantization
from omnistage.layers.fp8_checkpoint import Fp8CheckpointLinear
from omnistage.models.loader import load_model
from omnistage.testing.tiny_models import PagedCache
from tests.helpers.compressed_tensors import quantize_weight, write_fp8_checkpoint

CPU = torch.device("cpu")


PROMPTS = [[5, 17, 3, 99, 42, 7, 250], [11, 2, 300, 64, 9]]            # odd lengths, batch of 2


def logits(model: torch.nn.Module) -> torch.Tensor:
    """(sum of prompt lengths, vocab) float32 logits of both prompts, batched."""
    hidden, _ = PagedCache(model).run(model, [(i, torch.tensor(p)) for i, p in enumerate(PROMPTS)])
    with torch.no_grad():
        return model.compute_logits(torch.cat(hidden))


@pytest.fixture(scope="module")
def fp8_dirs(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_ckpt")
    return {"channel": write_fp8_checkpoint(tiny_qwen3, root / "channel"),
            "mixed": write_fp8_checkpoint(tiny_qwen3, root / "mixed", attention="tensor",
                                          mlp="tensor", scale_dtype=torch.bfloat16)}


def test_channel_layout_equals_load_time_fp8(tiny_qwen3: Path, fp8_dirs: dict[str, Path]
                                             ) -> None:
    loaded, _, _ = load_model(fp8_dirs["channel"], CPU, torch.float32)
    layers = [n for n, m in loaded.named_modules() if isinstance(m, Fp8CheckpointLinear)]
    assert len(layers) == 2 * 4 and all(p.dtype == torch.float8_e4m3fn for n, p in
                                        loaded.named_parameters() if n.endswith("proj.weight"))
    ours, _, _ = load_model(tiny_qwen3, CPU, torch.float32)
    want_float = logits(ours)
    quantize_model(ours, ComponentQuantization("fp8"), CPU, allow_cpu=True)
    want, got = logits(ours), logits(loaded)
    assert want_float.abs().mean() > 0.3                            # not a near-zero output
    assert (want - want_float).abs().max() > 1e-3                   # FP8 shows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_per_tensor_scales_dequantize_as_the_layout(tiny_qwen3: Path,
                                                    fp8_dirs: dict[str, Path]) -> None:
    """Each fused linear's rows equal the file's q * scale of the projection they come from
    (q, k, v and gate, up with their own per-tensor bf16 scales), and the model runs close to
    the float one."""
    from safetensors.torch import load_file

    loaded, _, _ = load_model(fp8_dirs["mixed"], CPU, torch.float32)
    floats = load_file(tiny_qwen3 / "model.safetensors")
    for i in range(2):
        attn, mlp = loaded.model.layers[i].self_attn, loaded.model.layers[i].mlp
        for fused, parts in ((attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj",
                                               "self_attn.v_proj")),
                             (mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj"))):
            want = []
            for part in parts:
                q, scale = quantize_weight(floats[f"model.layers.{i}.{part}.weight"], "tensor",
                                           torch.bfloat16)
                want.append(q.float() * scale.float())
            got = fused.weight.float() * fused.weight_scale
            torch.testing.assert_close(got, torch.cat(want), rtol=0, atol=0)
    ours, _, _ = load_model(tiny_qwen3, CPU, torch.float32)
    want, got = logits(ours), logits(loaded)
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() > 0.99, cos.min()


def test_refusals(tiny_qwen3: Path, fp8_dirs: dict[str, Path], tmp_path: Path) -> None:
    import json
    import shutil

    loaded_dir = fp8_dirs["channel"]
    with pytest.raises(ValueError, match="quantized already"):
        model, _, _ = load_model(loaded_dir, CPU, torch.float32)
        quantize_model(model, ComponentQuantization("int8"), CPU)
    block = shutil.copytree(loaded_dir, tmp_path / "block")
    config = json.loads((block / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic", "fmt": "e4m3"}
    (block / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="block-wise FP8"):
        load_model(block, CPU, torch.float32)
    config["quantization_config"] = json.loads(
        (loaded_dir / "config.json").read_text())["quantization_config"]
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    (block / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="group_0.input_activations: dynamic FP8"):
        load_model(block, CPU, torch.float32)
