"""AutoAWQ (GEMM) and GPTQ checkpoints (models/awq_gptq.py, layers/awq_gptq.py) load straight
into 4-bit linears: the tiny Qwen3 written in each layout (tests/helpers/awq_gptq_checkpoint.py,
packed from the documented formulas; its packing is checked against AutoAWQ's and AutoGPTQ's
own in tests/unit/layers/test_awq_gptq.py) dequantizes to exactly the weights the layout stands
for, gives the logits of a float32 model holding them, and the AR engine's greedy tokens equal
that reference's. Tensor-parallel shards take each rank's rows or columns (act order: every
group on each row-parallel rank); configurations not read are refused by name."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig
from omnistage.layers.awq_gptq import PackedInt4Linear, PackedLayout
from omnistage.layers.parallel import (MergedColumnParallelLinear, QKVParallelLinear,
                                       RowParallelLinear, TPGroup, set_tp_group)
from omnistage.models.loader import load_model
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_models import PagedCache
from tests.helpers.awq_gptq_checkpoint import pack_linear, write_packed_checkpoint

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 3, 99, 42, 7, 250], [11, 2, 300, 64, 9]]
LAYOUTS = {
    "awq": dict(method="awq"),
    "gptq_sym": dict(method="gptq", sym=True),
    "gptq_asym_v1": dict(method="gptq", fmt="gptq"),
    "gptq_v2_act_order": dict(method="gptq", fmt="gptq_v2", act_order=True),
    "gptq_sym_act_order_channel": dict(method="gptq", sym=True, act_order=True, group_size=-1),
}


@pytest.fixture(scope="module")
def dirs(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("awq_gptq")
    return {name: write_packed_checkpoint(tiny_qwen3, root / name, root / f"{name}_ref", **kw)
            for name, kw in LAYOUTS.items()}


def logits(model: torch.nn.Module) -> torch.Tensor:
    hidden, _ = PagedCache(model).run(model, [(i, torch.tensor(p)) for i, p in enumerate(PROMPTS)])
    with torch.no_grad():
        return model.compute_logits(torch.cat(hidden))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_loads_packed_and_equals_the_dequantized_model(dirs: dict, name: str) -> None:
    packed, ref_dir = dirs[name]
    model, _, _ = load_model(packed, CPU, torch.float32)
    ref, _, _ = load_model(ref_dir, CPU, torch.float32)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, PackedInt4Linear)}
    assert len(layers) == 2 * 4                       # qkv, o, gate_up, down in both layers
    assert type(model.lm_head).__name__ == "ParallelLMHead"           # not quantized
    for n, m in layers.items():                       # exactly the weights the file stands for
        assert torch.equal(m.dequantized(torch.float32), ref.get_submodule(n).weight), n
    _, _, zero, g_idx = layers["model.layers.0.self_attn.qkv_proj"].parts()
    assert (zero is None) == LAYOUTS[name].get("sym", False)
    assert (g_idx is None) != LAYOUTS[name].get("act_order", False)
    torch.testing.assert_close(logits(model), logits(ref), rtol=1e-5, atol=1e-5)


def greedy(path: Path) -> tuple[AREngine, list[list[int]]]:
    engine = AREngine(ARConfig(model=str(path), device="cpu", dtype="float32"))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(400) for _ in range(n)] for n in (3, 17, 40)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return engine, [out[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["awq", "gptq_sym", "gptq_v2_act_order"])
def test_engine_tokens_equal_the_dequantized_model(dirs: dict, name: str) -> None:
    engine, got = greedy(dirs[name][0])
    assert sum(isinstance(m, PackedInt4Linear) for m in engine.model.modules()) == 8
    assert got == greedy(dirs[name][1])[1]


def _shard(build, rank: int, world: int) -> torch.nn.Module:
    set_tp_group(TPGroup(rank, world, None))
    try:
        return build()
    finally:
        set_tp_group(None)


def _fill(layer: torch.nn.Module, tensors: dict, shard: int | str | None = None) -> None:
    for name, param in layer.named_parameters():
        if name != "bias":
            args = (param, tensors[name]) if shard is None else (param, tensors[name], shard)
            param.weight_loader(*args)


@pytest.mark.parametrize("kind", ["awq", "gptq_act_order"])
def test_tensor_parallel_shards(kind: str) -> None:
    """Two ranks: fused column layers take their rows of every part, a row-parallel one its
    columns (act order: its columns' g_idx and every group), and the ranks' products stack
    (or sum) to the whole layer's."""
    torch.manual_seed(0)
    method, act = ("awq", False) if kind == "awq" else ("gptq", True)
    layout = PackedLayout(method, 32, act_order=act)
    k, world = 128, 2
    weights = {"q": torch.randn(64, k), "k": torch.randn(32, k), "v": torch.randn(32, k),
               0: torch.randn(64, k), 1: torch.randn(64, k), "down": torch.randn(48, k)}
    packed = {s: pack_linear(w, method, 32, False, act, "gptq_v2",
                             seed=7 if s in ("q", "k", "v") else 9 if s in (0, 1) else 11)
              for s, w in weights.items()}
    x = torch.randn(3, k)
    want = {s: x @ ref.T for s, (_, ref) in packed.items()}
    partial = torch.zeros(3, 48)
    for rank in range(world):
        qkv = _shard(lambda: PackedInt4Linear(QKVParallelLinear(k, 16, 4, 2), layout), rank,
                     world)
        mlp = _shard(lambda: PackedInt4Linear(MergedColumnParallelLinear(k, [64, 64]), layout),
                     rank, world)
        row = _shard(lambda: PackedInt4Linear(RowParallelLinear(k, 48, bias=True,
                                                                reduce_results=False),
                                              layout), rank, world)
        for s in "qkv":
            _fill(qkv, packed[s][0], s)
        for s in (0, 1):
            _fill(mlp, packed[s][0], s)
        _fill(row, packed["down"][0])
        row.bias.weight_loader(row.bias, torch.ones(48))
        got = qkv(x)                                                  # | q_r | k_r | v_r |
        torch.testing.assert_close(got[:, :32], want["q"][:, rank * 32:(rank + 1) * 32])
        torch.testing.assert_close(got[:, 32:48], want["k"][:, rank * 16:(rank + 1) * 16])
        torch.testing.assert_close(got[:, 48:], want["v"][:, rank * 16:(rank + 1) * 16])
        got = mlp(x)                                                  # | gate_r | up_r |
        torch.testing.assert_close(got[:, :32], want[0][:, rank * 32:(rank + 1) * 32])
        torch.testing.assert_close(got[:, 32:], want[1][:, rank * 32:(rank + 1) * 32])
        partial += row(x[:, rank * k // world:(rank + 1) * k // world])
    torch.testing.assert_close(partial, want["down"] + 1, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="tensor parallelism 4: a row-parallel"):
        _shard(lambda: PackedInt4Linear(RowParallelLinear(128, 48), PackedLayout("awq", 64)),
               0, 4)


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("layout,changes,message", [
    ("awq", {"bits": 8}, "awq with bits 8 is not read"),
    ("awq", {"version": "gemv"}, "awq version 'gemv' is not read"),
    ("awq", {"version": "exllama"}, "awq version 'exllama' is not read"),
    ("awq", {"zero_point": False}, r"awq without zero points"),
    ("awq", {"backend": "llm-awq"}, "awq backend 'llm-awq' is not read"),
    ("gptq_sym", {"bits": 3}, "gptq with bits 3 is not read"),
    ("gptq_sym", {"checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin'"),
    ("gptq_sym", {"lm_head": True}, "a quantized lm_head"),
    ("gptq_v2_act_order", {"desc_act": False}, "g_idx is not k // group_size"),
    ("gptq_asym_v1", {"sym": True}, "sym true but zero points other than 8"),
])
def test_refusals(dirs: dict, tmp_path: Path, layout: str, changes: dict, message: str) -> None:
    bad = _with_config(dirs[layout][0], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        load_model(bad, CPU, torch.float32)


def test_fused_parts_with_different_g_idx_are_refused(tiny_qwen3: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """GPTQ orders the columns of q/k/v (and gate/up) by their one input; a file whose parts
    disagree cannot share one g_idx and is refused."""
    from tests.helpers import awq_gptq_checkpoint as helper

    monkeypatch.setitem(helper.INPUT_OF, "k_proj", "k_alone")
    packed, _ = write_packed_checkpoint(tiny_qwen3, tmp_path / "q", tmp_path / "r",
                                        method="gptq", act_order=True)
    with pytest.raises(ValueError, match="different g_idx"):
        load_model(packed, CPU, torch.float32)


def test_qwen2_with_qkv_biases(tiny_qwen2: Path, tmp_path: Path) -> None:
    """Qwen2's q/k/v biases stay float beside the AWQ words, each part's into its rows."""
    packed, ref = write_packed_checkpoint(tiny_qwen2, tmp_path / "awq", tmp_path / "reference",
                                          method="awq")
    model, _, _ = load_model(packed, CPU, torch.float32)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, PackedInt4Linear) and qkv.bias.abs().sum() > 0
    want, _, _ = load_model(ref, CPU, torch.float32)
    torch.testing.assert_close(logits(model), logits(want), rtol=1e-5, atol=1e-5)
