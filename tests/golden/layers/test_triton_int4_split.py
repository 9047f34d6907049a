"""The split-K 4-bit matrix-vector kernel (triton_int4_split.py) against the float32 matmul of
the dequantized weight (layers/int4.py's dequantize_int4), at odd shapes, 1 to 4 rows and every
split of K it can take; and the switch in triton_int4.py that picks it. Without a GPU the
kernels run in Triton's interpreter on CPU tensors, in a child process (TRITON_INTERPRET must be
set before `import torch`); tests/gpu/test_int4_split_cuda.py runs them compiled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from omnistage.testing.interpreter import (INTERPRETING, patch_interpreter,  # noqa: E402
                                           run_in_interpreter)

from omnistage.layers import fused  # noqa: E402
from omnistage.layers.int4 import Int4Linear, dequantize_int4, quantize_int4  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_HERE = torch.cuda.is_available() or INTERPRETING
kernel_test = pytest.mark.skipif(not KERNELS_HERE, reason="runs in the interpreter child")

if DEVICE.type == "cpu" and KERNELS_HERE:
    patch_interpreter()


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    run_in_interpreter(__file__)


def _weights(n: int, k: int, group: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    weight = torch.randn(n, k) * torch.linspace(0.2, 2.0, k)   # groups of unequal range
    packed, scale = quantize_int4(weight, group, torch.bfloat16)
    return packed.to(DEVICE), scale.to(DEVICE)


def _reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    w = dequantize_int4(packed, scale.float(), x.shape[1], group)     # exact q * s, float32
    return F.linear(x.float(), w, None if bias is None else bias.float())


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 1e-4 * max(1.0, float(want.abs().max()))                     # the output's scale
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=1e-4)
    assert want.abs().mean() > 0.5                                     # not a near-zero output


# (N, K, G, BLOCK_N, BLOCK_K): K not whole words (100, 1100 + 3) nor tiles, N odd or a block
# and a part (70 in 64s), a short last group, a tile of one group or of several, groups of 32,
# 64 and 128
SHAPES = [(21, 100, 32, 8, 32), (24, 1100, 128, 8, 256), (33, 520, 32, 16, 128),
          (19, 1103, 128, 16, 128), (9, 2048, 64, 4, 512), (70, 600, 128, 64, 256)]


@kernel_test
@pytest.mark.parametrize("n, k, group, block_n, block_k", SHAPES)
def test_every_split_equals_the_dequantized_matmul(n: int, k: int, group: int, block_n: int,
                                                   block_k: int) -> None:
    """Splits of K 1, 2, 3, 8 and one a tile (the table's range is 1 to 8), rows 1 to 4, with
    and without a bias; uneven splits (5 tiles in 3) and more splits than tiles too."""
    from omnistage.layers import triton_int4_split as ts

    packed, scale = _weights(n, k, group)
    num_tiles = -(-k // max(block_k, group))
    for split in sorted({1, 2, 3, min(8, num_tiles), num_tiles, num_tiles + 2}):
        cfg = dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4,
                   num_stages=1)
        for rows in (1, 2, 3, 4) if split == 1 else (split % 4 + 1,):
            x = torch.randn(rows, k, device=DEVICE)
            bias = torch.randn(n, device=DEVICE) * 4 if (rows + split) % 2 else None
            got = ts.linear(x, packed, scale, group, bias, cfg)
            assert got.shape == (rows, n) and got.dtype == x.dtype
            _check(got, _reference(x, packed, scale, group, bias))


@kernel_test
def test_each_group_takes_its_own_scale() -> None:
    """One group's scale alone nonzero, in turn: the output is that group's slice of the
    product, so a scale read for the wrong group (or a tile or split that skips one) shows."""
    from omnistage.layers import triton_int4_split as ts

    n, k, group = 4, 264, 32                                   # 9 groups, the last 8 wide
    packed, scale = _weights(n, k, group, seed=1)
    x = torch.randn(2, k, device=DEVICE)
    cfg = dict(BLOCK_N=4, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=1)
    for g in range(scale.shape[1]):
        only = torch.zeros_like(scale)
        only[:, g] = scale[:, g] + 0.5                         # never a zero scale
        want = _reference(x, packed, only, group, None)
        assert want.abs().max() > 0
        got = ts.linear(x, packed, only, group, None, cfg)
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)


@kernel_test
def test_default_and_table_tiles() -> None:
    """Shapes outside TILES take default_config (splits up to about TARGET_PROGRAMS programs,
    at least one tile each); a shape and row count in it takes its entry; load_tiles reads the
    sweep's JSON into it; both give the reference's output."""
    from omnistage.layers import triton_int4_split as ts

    cfg = ts.default_config(1024, 3072, 128)
    assert cfg["SPLIT_K"] > 1 and cfg["BLOCK_K"] % 128 == 0
    assert -(-1024 // cfg["BLOCK_N"]) * cfg["SPLIT_K"] >= ts.TARGET_PROGRAMS // 2
    assert ts.default_config(24576, 4096, 128)["SPLIT_K"] == 1      # 384 programs unsplit
    packed, scale = _weights(40, 1100, 128)
    x = torch.randn(1, 1100, device=DEVICE)
    want = _reference(x, packed, scale, 128, None)
    _check(ts.linear(x, packed, scale, 128), want)
    entry = dict(BLOCK_N=4, BLOCK_K=128, SPLIT_K=5, num_warps=4, num_stages=1)
    saved = dict(ts.TILES)
    try:
        ts.TILES[(40, 1100, 1)] = entry
        assert ts.config(40, 1100, 128) == entry
        assert ts.config(40, 1100, 128, rows=3) == ts.default_config(40, 1100, 128, 3)
        _check(ts.linear(x, packed, scale, 128), want)
        ts.TILES.clear()
        assert ts.load_tiles({"tiles": [{"n": 40, "k": 1100, "rows": 3, **entry}]}) == 1
        assert ts.config(40, 1100, 128, rows=4) == entry           # 3 rows run as 4
        x3 = torch.randn(3, 1100, device=DEVICE)
        _check(ts.linear(x3, packed, scale, 128), _reference(x3, packed, scale, 128, None))
    finally:
        ts.TILES.clear()
        ts.TILES.update(saved)


@kernel_test
def test_switch_picks_the_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """triton_int4.linear (and so Int4Linear) takes the split kernel after set_kernel("split")
    and the first one after set_kernel("rows") or by default here, the same outputs; an unknown
    name is refused; groups not a power of two words stay on the first kernel."""
    from omnistage.layers import triton_int4, triton_int4_split

    calls = []
    real = triton_int4_split.linear
    monkeypatch.setattr(triton_int4_split, "linear",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(fused, "_interpret", DEVICE.type == "cpu")
    packed, scale = _weights(21, 96, 32)
    scale = scale.float()               # the first kernel's weights exact too (q * s)
    layer = Int4Linear(packed, scale, 96, 32, torch.randn(21, device=DEVICE))
    x = torch.randn(3, 96, device=DEVICE)
    want = _reference(x, packed, scale, 32, layer.bias)
    try:
        for name, split in ((None, False), ("split", True), ("rows", False)):
            triton_int4.set_kernel(name)
            calls.clear()
            _check(layer(x), want)
            assert bool(calls) == split, (name, calls)
        triton_int4.set_kernel("split")
        packed48, scale48 = _weights(5, 96, 48)                # 6 words a group: not 2^i
        scale48 = scale48.float()
        calls.clear()
        _check(triton_int4.linear(x, packed48, scale48, 48),
               _reference(x, packed48, scale48, 48, None))
        assert not calls
    finally:
        triton_int4.set_kernel(None)
    with pytest.raises(ValueError, match="int4 kernel"):
        triton_int4.set_kernel("fast")
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"tiles": []}))
    assert triton_int4_split.load_tiles(json.loads(path.read_text())) == 0
