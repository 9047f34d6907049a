"""benchmarks/ar_quant.py end to end on the tiny Qwen3 (CPU, float32 reference): its command
line builds the reference, fp8 (load-time, torch's CPU `_scaled_mm`) and int8 engines from one
checkpoint, and the JSON it writes holds issue 44's headline with figures that agree with one
another and with the checkpoint: the reference forced through its own greedy stream ranks it
first everywhere, a method's teacher-forced stream first differs exactly where its free
running stream leaves the reference's (the same context up to there), and the weight bytes are
the float model's less its eight linears' float32 weights plus their int8 / e4m3 bytes and one
float32 scale per output channel."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from omnistage.benchmarks.ar_quant import main, run
from omnistage.benchmarks.common import parameter_bytes
from omnistage.layers.fp8 import LINEARS
from omnistage.models.loader import load_model

INPUT_LEN, OUTPUT_LEN = 40, 32


def expected_weight_bytes(path: Path) -> tuple[int, int]:
    """(the float32 model's bytes, the same with every linear but the head in 8 bits)."""
    model, _, _ = load_model(path, torch.device("cpu"), torch.float32)
    linears = [m for name, m in model.named_modules()
               if isinstance(m, LINEARS) and not name.endswith("_head")]
    assert len(linears) == 2 * 4, len(linears)          # qkv, o, gate_up, down per layer
    float_bytes = sum(m.weight.numel() * 4 for m in linears)
    eight_bit = sum(m.weight.numel() + 4 * m.weight.shape[0] for m in linears)
    total = parameter_bytes(model)
    return total, total - float_bytes + eight_bit


def test_fp8_and_int8_against_the_reference(tiny_qwen3: Path, tmp_path: Path) -> None:
    out = tmp_path / "ar_quant.json"
    returned = main(["--checkpoint", str(tiny_qwen3), "--methods", "fp8,int8", "--device", "cpu",
                     "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                     "--repeats", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["headline"] == returned["headline"]
    ref, head = result["reference"], result["headline"]
    assert result["dtype"] == "float32" and result["output_len"] == OUTPUT_LEN
    assert ref["forced"]["num_tokens"] == OUTPUT_LEN and ref["self_agreement"] == 1.0
    assert ref["deterministic"] and ref["num_quantized_linears"] == 0
    float_bytes, eight_bit_bytes = expected_weight_bytes(tiny_qwen3)
    assert ref["weight_bytes"] == float_bytes
    for m in ("fp8", "int8"):
        r = result["methods"][m]
        forced, greedy = r["forced"], r["greedy"]
        assert forced["num_tokens"] == greedy["num_tokens"] == OUTPUT_LEN
        assert 0.0 <= greedy["prefix"] <= forced["share"] <= 1.0, (m, greedy, forced)
        assert forced["first_divergence"] == greedy["first_divergence"], (m, forced, greedy)
        if greedy["first_divergence"] is not None:
            assert greedy["prefix"] == greedy["first_divergence"] / OUTPUT_LEN
        assert r["num_quantized_linears"] == 2 * 4 and r["deterministic"]
        assert r["weight_bytes"] == eight_bit_bytes, (m, r["weight_bytes"], eight_bit_bytes)
        speedup = head[f"ar_{m}_decode_speedup"]
        assert isinstance(speedup, float) and math.isfinite(speedup) and speedup > 0
        assert speedup == pytest.approx(r["decode_tokens_per_s"] / ref["decode_tokens_per_s"])
        assert len(r["runs_tokens_per_s"]) == 2 and min(r["runs_tokens_per_s"]) > 0
        assert head[f"ar_{m}_token_agreement"] == forced["share"]
        assert head[f"ar_{m}_greedy_prefix_agreement"] == greedy["prefix"]
        assert head[f"ar_{m}_weight_bytes_ratio"] == pytest.approx(eight_bit_bytes / float_bytes)
    print("headline:", head)
    # a small model with per-channel / per-token 8-bit error: most argmaxes hold when forced
    assert head["ar_int8_token_agreement"] >= 0.9 and head["ar_fp8_token_agreement"] >= 0.75


@pytest.mark.parametrize("methods, output_len, message", [
    (("int2",), 8, "methods: 'int2' is not one of fp8, int8, int4"),
    (("int8",), 1, "need output_len >= 2"),
])
def test_bad_arguments_are_refused(tiny_qwen3: Path, methods: tuple[str, ...], output_len: int,
                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run(tiny_qwen3, methods, [1, 2, 3], output_len, device="cpu")
