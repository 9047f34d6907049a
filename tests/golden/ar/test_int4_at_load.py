"""`ar.quantization: int4` (ar/quantize.py) quantizes a float checkpoint's linears at load to
W4A16 Int4Linear (symmetric groups of 128, layers/int4.py `quantize_int4`, scales in the
weight's dtype). The reference is the same float32 model whose swapped linears hold the
dequantized weights (quantize_int4, then dequantize_int4), the head untouched: the engine's
greedy tokens are those of the reference and the logits agree to 1e-5. A tensor-parallel
layer's shards, quantized rank by rank, give the whole layer's int4 product; a row-parallel
shard of partial groups is refused."""

from __future__ import annotations

import fnmatch
import random
from pathlib import Path

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.configs.quantization import ComponentQuantization
from omnistage.configs.schema import ARConfig
from omnistage.layers.fp8 import LINEARS
from omnistage.layers.int4 import Int4Linear, dequantize_int4, quantize_int4
from omnistage.layers.parallel import (ColumnParallelLinear, RowParallelLinear, TPGroup,
                                       set_tp_group)
from omnistage.models.loader import load_model
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_models import PagedCache, build_tiny_checkpoint

CPU = torch.device("cpu")
GROUP = 128
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 whose linears span whole groups (K = 256: q/k/v, gate/up) and a partial
    last one (down: K = 320 = 2.5 groups; o: K = 4 heads x 64 = 256)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("int4_at_load"), "Qwen3ForCausalLM",
                                 hidden_size=256, intermediate_size=320, head_dim=64)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(400) for _ in range(n)] for n in (3, 17, 40)]


def dequantized_loader(path: Path, device: torch.device, dtype: torch.dtype | None) -> tuple:
    """The float model whose linears but the heads hold their int4 round trip."""
    model, cfg, hf = load_model(path, device, dtype)
    for name, module in model.named_modules():
        if isinstance(module, LINEARS) and not fnmatch.fnmatchcase(name, "*_head"):
            w = module.weight.data
            packed, scale = quantize_int4(w, GROUP, w.dtype)
            w.copy_(dequantize_int4(packed, scale, w.shape[1], GROUP))
    return model, cfg, hf


def engine(path: Path, quantization: str | None = None, loader=None) -> AREngine:
    q = ComponentQuantization(quantization) if quantization else None
    return AREngine(ARConfig(model=str(path), device="cpu", dtype="float32", quantization=q),
                    loader=loader)


def greedy(e: AREngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while e.has_unfinished_requests:
        for o in e.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


def logits(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    rows = [(i, torch.tensor(p)) for i, p in enumerate(prompts)]
    hidden, _ = PagedCache(model, num_blocks=64).run(model, rows)
    with torch.no_grad():
        return model.compute_logits(torch.cat(hidden))


def test_engine_equals_the_dequantized_model(checkpoint: Path,
                                             prompts: list[list[int]]) -> None:
    int4 = engine(checkpoint, "int4")
    ref = engine(checkpoint, loader=dequantized_loader)
    flt, _, _ = load_model(checkpoint, CPU, torch.float32)
    swapped = {n for n, m in int4.model.named_modules() if isinstance(m, Int4Linear)}
    assert swapped == {n for n, m in flt.named_modules()
                       if isinstance(m, LINEARS) and not n.endswith("_head")}
    assert len(swapped) == 2 * 4                        # qkv, o, gate_up, down in both layers
    assert type(int4.model.lm_head).__name__ == "ParallelLMHead"       # the head untouched
    torch.testing.assert_close(int4.model.lm_head.weight, flt.lm_head.weight, rtol=0, atol=0)
    down = int4.model.model.layers[0].mlp.down_proj
    assert (down.in_features, down.group_size, down.weight_scale.shape[1]) == (320, GROUP, 3)
    assert down.weight_packed.dtype == torch.int32 and down.weight_scale.dtype == torch.float32
    w = flt.model.layers[0].mlp.down_proj.weight            # round to nearest: half a step
    step = down.weight_scale.repeat_interleave(GROUP, 1)[:, :320]
    assert ((down.dequantized(torch.float32) - w).abs() <= step / 2 + 1e-6).all()
    torch.testing.assert_close(logits(int4.model, prompts), logits(ref.model, prompts),
                               rtol=1e-5, atol=1e-5)
    assert greedy(int4, prompts) == greedy(ref, prompts)


def _shard(build, rank: int, world: int) -> torch.nn.Module:
    set_tp_group(TPGroup(rank, world, None))
    try:
        return build()
    finally:
        set_tp_group(None)


def loaded(cls, k: int, n: int, w: torch.Tensor, b: torch.Tensor, rank: int, world: int,
           **kw) -> torch.nn.Module:
    """Rank `rank`'s shard of a `cls` layer holding the whole weight `w` and bias `b`."""
    layer = _shard(lambda: cls(k, n, bias=True, **kw), rank, world)
    layer.weight.weight_loader(layer.weight, w)
    layer.bias.weight_loader(layer.bias, b)
    return layer


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_shards(world: int) -> None:
    """Column-parallel: each rank's rows quantized alone are the whole layer's rows (groups
    run along K). Row-parallel: K / R whole groups, so the ranks' partial products (rank 0's
    with the bias) sum to the whole int4 layer's."""
    torch.manual_seed(0)
    k, n = 1024, 96
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(3, k)
    want = Int4Linear.from_linear(loaded(RowParallelLinear, k, n, w, b, 0, 1))(x)
    partial, cols = torch.zeros(3, n), []
    for rank in range(world):
        q = Int4Linear.from_linear(loaded(RowParallelLinear, k, n, w, b, rank, world,
                                          reduce_results=False))
        assert (q.in_features, q.tp.rank, q.reduce_results) == (k // world, rank, False)
        partial += q(x[:, rank * k // world:(rank + 1) * k // world])
        col = loaded(ColumnParallelLinear, k, n, w, b, rank, world)
        cols.append(Int4Linear.from_linear(col)(x))
    torch.testing.assert_close(partial, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.cat(cols, -1), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=f"int4 with tensor parallelism {world}: a "
                                         f"row-parallel linear's {384 // world} inputs a rank "
                                         "are not whole groups of 128"):
        Int4Linear.from_linear(_shard(lambda: RowParallelLinear(384, n), 0, world))
