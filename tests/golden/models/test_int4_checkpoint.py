"""A checkpoint that ships 4-bit weights in compressed-tensors' W4A16 `pack-quantized` layout
(models/compressed_tensors.py int4_linears) loads straight into Int4 linears: the tiny Qwen3
written in that layout (tests/helpers/int4_checkpoint.py, packed as compressed-tensors packs)
gives the logits of a float32 model whose linears hold the dequantized weights (q * scale),
and the AR engine's greedy tokens equal that reference's; against the float model they are
reported (docs/quantization.md). Tensor-parallel shards load each rank's rows (q/k/v,
gate/up) or columns (down, o) of the words and scales."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.ar.engine import AREngine
from omnistage.ar.quantize import quantize_model
from omnistage.configs.quantization import ComponentQuantization
from omnistage.configs.schema import ARConfig
from omnistage.layers.int4 import dequantize_int4, pack_int4
from omnistage.layers.int4_checkpoint import Int4CheckpointLinear
from omnistage.layers.parallel import (MergedColumnParallelLinear, QKVParallelLinear,
                                       RowParallelLinear, TPGroup, set_tp_group)
from omnistage.models.loader import load_model
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_models import PagedCache
from tests.helpers.int4_checkpoint import quantize_groups, write_int4_checkpoint

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 3, 99, 42, 7, 250], [11, 2, 300, 64, 9]]            # odd lengths, batch of 2
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def int4_dirs(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4_ckpt")
    packed, ref = write_int4_checkpoint(tiny_qwen3, root / "int4", root / "dequantized")
    return {"int4": packed, "reference": ref, "float": tiny_qwen3}


def logits(model: torch.nn.Module) -> torch.Tensor:
    """(sum of prompt lengths, vocab) float32 logits of both prompts, batched."""
    hidden, _ = PagedCache(model).run(model, [(i, torch.tensor(p)) for i, p in enumerate(PROMPTS)])
    with torch.no_grad():
        return model.compute_logits(torch.cat(hidden))


def test_loads_packed_and_equals_the_dequantized_model(int4_dirs: dict[str, Path]) -> None:
    loaded, _, _ = load_model(int4_dirs["int4"], CPU, torch.float32)
    layers = [m for m in loaded.modules() if isinstance(m, Int4CheckpointLinear)]
    assert len(layers) == 2 * 4                       # qkv, o, gate_up, down in both layers
    assert all(m.weight_packed.dtype == torch.int32 for m in layers)
    assert type(loaded.lm_head).__name__ == "ParallelLMHead"          # ignored: stays float
    ref, _, _ = load_model(int4_dirs["reference"], CPU, torch.float32)
    flt, _, _ = load_model(int4_dirs["float"], CPU, torch.float32)
    qkv = loaded.model.layers[0].self_attn.qkv_proj                    # rows | q | k | v |
    torch.testing.assert_close(qkv.dequantized(torch.float32),
                               ref.model.layers[0].self_attn.qkv_proj.weight, rtol=0, atol=0)
    want, got, want_float = logits(ref), logits(loaded), logits(flt)
    assert want_float.abs().mean() > 0.3                               # not a near-zero output
    assert (want - want_float).abs().max() > 1e-2                      # 4 bits show
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="quantized already"):
        quantize_model(loaded, ComponentQuantization("int8"), CPU)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(400) for _ in range(n)] for n in (3, 17, 40, 99)]


def greedy(path: Path) -> tuple[AREngine, list[list[int]]]:
    engine = AREngine(ARConfig(model=str(path), device="cpu", dtype="float32"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts()))}
    while engine.has_unfinished_requests:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return engine, [out[str(i)] for i in range(len(prompts()))]


def top1(model: torch.nn.Module, want: list[list[int]]) -> float:
    """Share of `want`'s tokens that `model` ranks first given the prompt and `want` before
    (teacher forcing: the float model's stream fed to the quantized one)."""
    rows = [(i, torch.tensor(p + w[:-1])) for i, (p, w) in enumerate(zip(prompts(), want))]
    hidden, _ = PagedCache(model, num_blocks=128).run(model, rows)
    hits = 0
    for h, p, w in zip(hidden, prompts(), want):
        with torch.no_grad():
            hits += int((model.compute_logits(h[len(p) - 1:]).argmax(-1)
                         == torch.tensor(w)).sum())
    return hits / sum(map(len, want))


def test_engine_tokens_equal_the_dequantized_model(int4_dirs: dict[str, Path]) -> None:
    engine, got = greedy(int4_dirs["int4"])
    assert sum(isinstance(m, Int4CheckpointLinear) for m in engine.model.modules()) == 8
    _, want = greedy(int4_dirs["reference"])
    assert got == want
    _, flt = greedy(int4_dirs["float"])
    prefix = sum(next((i for i, (a, b) in enumerate(zip(g, f)) if a != b), len(f)) / len(f)
                 for g, f in zip(got, flt)) / len(flt)
    ranked = top1(engine.model, flt)
    print(f"int4 (group 32) against float32: top-1 {ranked:.1%}, greedy prefix {prefix:.1%}")
    assert ranked >= 0.5, ranked                # 4 bits on a tiny random model: see the docs


def _shard(build, rank: int, world: int) -> torch.nn.Module:
    set_tp_group(TPGroup(rank, world, None))
    try:
        return build()
    finally:
        set_tp_group(None)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_shards(world: int) -> None:
    """Each rank's words and scales are its rows (fused column layers: of every part) or its
    columns (row-parallel), and the ranks' products sum (or stack) to the whole."""
    torch.manual_seed(0)
    k, group = 256, 32
    parts = {"q": torch.randn(64, k), "k": torch.randn(32, k), "v": torch.randn(32, k)}
    down, gate_up = torch.randn(48, k), {0: torch.randn(48, k), 1: torch.randn(48, k)}
    tensors = {}
    for name, w in {**parts, "down": down, **gate_up}.items():
        q, scale = quantize_groups(w, group, torch.bfloat16)
        tensors[name] = (pack_int4(q), scale, torch.tensor(w.shape),
                         dequantize_int4(pack_int4(q), scale.float(), k, group))
    x = torch.randn(3, k)
    outs, partial, mlp_outs = [], torch.zeros(3, 48), []
    for rank in range(world):
        mlp = _shard(lambda: Int4CheckpointLinear(MergedColumnParallelLinear(k, [48, 48]),
                                                  group), rank, world)
        for shard in (0, 1):
            for param, t in zip(("weight_packed", "weight_scale", "weight_shape"),
                                tensors[shard]):
                mlp.get_parameter(param).weight_loader(mlp.get_parameter(param), t, shard)
        mlp_outs.append(mlp(x))                                      # | gate_r | up_r |
        qkv = _shard(lambda: Int4CheckpointLinear(QKVParallelLinear(k, 16, 4, 2), group),
                     rank, world)
        row = _shard(lambda: Int4CheckpointLinear(      # the caller sums (no process group)
            RowParallelLinear(k, 48, bias=True, reduce_results=False), group), rank, world)
        for shard in "qkv":
            for param, t in zip(("weight_packed", "weight_scale", "weight_shape"),
                                tensors[shard]):
                qkv.get_parameter(param).weight_loader(qkv.get_parameter(param), t, shard)
        for param, t in zip(("weight_packed", "weight_scale", "weight_shape"), tensors["down"]):
            row.get_parameter(param).weight_loader(row.get_parameter(param), t)
        row.bias.weight_loader(row.bias, torch.ones(48))
        outs.append(qkv(x))                                          # (3, this rank's rows)
        xr = x[:, rank * k // world:(rank + 1) * k // world]
        partial += row(xr)                                # rank 0's part adds the bias
    want = {s: x @ tensors[s][3].T for s in "qkv"}
    q_rows = 64 // world
    kv_rows = 32 // world if world <= 2 else 16             # 2 kv heads: one a rank, shared
    for rank, out in enumerate(outs):
        kv_start = rank * kv_rows if world <= 2 else rank * 2 // world * 16
        torch.testing.assert_close(out[:, :q_rows], want["q"][:, rank * q_rows:][:, :q_rows])
        for i, part in enumerate("kv"):
            start = q_rows + i * kv_rows
            torch.testing.assert_close(out[:, start:start + kv_rows],
                                       want[part][:, kv_start:kv_start + kv_rows])
    rows = 48 // world
    for rank, out in enumerate(mlp_outs):
        for i in (0, 1):
            torch.testing.assert_close(out[:, i * rows:(i + 1) * rows],
                                       (x @ tensors[i][3].T)[:, rank * rows:(rank + 1) * rows])
    torch.testing.assert_close(partial, x @ tensors["down"][3].T + 1, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="tensor parallelism 4: a row-parallel"):
        _shard(lambda: Int4CheckpointLinear(RowParallelLinear(128, 48), 64), 0, 4)


def test_refusals(int4_dirs: dict[str, Path], tmp_path: Path) -> None:
    bad = shutil.copytree(int4_dirs["int4"], tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    for key, value, message in (("actorder", "group", "activation-ordered groups"),
                                ("symmetric", False, "asymmetric groups"),
                                ("num_bits", 8, "not int 8-bit by group")):
        (bad / "config.json").write_text(json.dumps({**config, "quantization_config": {
            **config["quantization_config"], "config_groups": {"group_0": {
                **config["quantization_config"]["config_groups"]["group_0"],
                "weights": {**weights, key: value}}}}}))
        with pytest.raises(ValueError, match=message):
            load_model(bad, CPU, torch.float32)
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight_zero_point"] = torch.zeros(64, 2)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"asymmetric groups \(weight_zero_point\)"):
        load_model(bad, CPU, torch.float32)


def test_export_writes_the_layout(int4_dirs: dict[str, Path], tmp_path: Path) -> None:
    """models/int4_export.py (a float checkpoint written again as W4A16) writes the tensors
    and config this test's writer does, and the folder loads."""
    from omnistage.models.int4_export import export_w4a16

    out = export_w4a16(int4_dirs["float"], tmp_path / "export", group_size=32)
    got, want = load_file(out / "model.safetensors"), load_file(int4_dirs["int4"] /
                                                                 "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == json.loads((int4_dirs["int4"] / "config.json").read_text()
                                )["quantization_config"]
    model, _, _ = load_model(out, CPU, torch.float32)
    assert sum(isinstance(m, Int4CheckpointLinear) for m in model.modules()) == 8
    with pytest.raises(FileExistsError):
        export_w4a16(int4_dirs["float"], out)


def test_qwen2_with_qkv_biases(tiny_qwen2: Path, tmp_path: Path) -> None:
    """Qwen2's q/k/v biases stay float beside the packed words, each part's into its rows."""
    packed, ref = write_int4_checkpoint(tiny_qwen2, tmp_path / "int4", tmp_path / "reference")
    loaded, _, _ = load_model(packed, CPU, torch.float32)
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4CheckpointLinear) and qkv.bias.abs().sum() > 0
    want, _, _ = load_model(ref, CPU, torch.float32)
    torch.testing.assert_close(logits(loaded), logits(want), rtol=1e-5, atol=1e-5)
