"""The fused Triton kernels (RMSNorm, residual add + RMSNorm, SiLU-and-mul, q/k norm + RoPE)
against the PyTorch paths they replace. On a GPU the kernels are compiled and also checked in
bfloat16; without one they run in Triton's interpreter on CPU tensors, in a child process
(TRITON_INTERPRET must be set before `import torch`, which imports triton)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from omnistage.testing.interpreter import (INTERPRETING, patch_interpreter,  # noqa: E402
                                           run_in_interpreter)

from omnistage.layers import fused, triton_ops  # noqa: E402
from omnistage.layers.activation import SiluAndMul  # noqa: E402
from omnistage.layers.norm import RMSNorm  # noqa: E402
from omnistage.layers.rotary import get_rope  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_HERE = torch.cuda.is_available() or INTERPRETING
kernel_test = pytest.mark.skipif(not KERNELS_HERE, reason="runs in the interpreter child")
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

if DEVICE.type == "cpu" and KERNELS_HERE:
    patch_interpreter()


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    run_in_interpreter(__file__)


def _torch_path(fn):  # type: ignore[no-untyped-def]
    """Run fn with the fused kernels switched off (the PyTorch reference path)."""
    fused.set_enabled(False)
    try:
        return fn()
    finally:
        fused.set_enabled(True)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-5).to(DEVICE, dtype)
    norm.weight.copy_(1 + 0.1 * torch.randn(48))
    x = (3 * torch.randn(5, 48)).to(DEVICE, dtype)
    res = torch.randn(5, 48).to(DEVICE, dtype)
    ref = _torch_path(lambda: norm(x))
    torch.testing.assert_close(triton_ops.rms_norm(x, norm.weight, 1e-5), ref, **TOL[dtype])
    # strided rows (a slice of a wider tensor) and more leading dims
    wide = torch.randn(5, 80).to(DEVICE, dtype)
    torch.testing.assert_close(triton_ops.rms_norm(wide[:, 16:64], norm.weight, 1e-5),
                               _torch_path(lambda: norm(wide[:, 16:64])), **TOL[dtype])
    x3 = x.view(5, 3, 16)
    norm16 = RMSNorm(16).to(DEVICE, dtype)
    torch.testing.assert_close(triton_ops.rms_norm(x3, norm16.weight, 1e-6),
                               _torch_path(lambda: norm16(x3)), **TOL[dtype])
    normed, total = triton_ops.add_rms_norm(x, res, norm.weight, 1e-5)
    ref_normed, ref_total = _torch_path(lambda: norm.add_forward(x, res))
    assert torch.equal(total, ref_total)
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = (2 * torch.randn(7, 2 * 40)).to(DEVICE, dtype)
    ref = _torch_path(lambda: SiluAndMul()(x))
    torch.testing.assert_close(triton_ops.silu_and_mul(x), ref, **TOL[dtype])


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope(dtype: torch.dtype, qk_norm: bool) -> None:
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim, T = 6, 2, 16, 9
    rope = get_rope(head_dim, 256, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim).to(DEVICE, dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q, k = q.view(T, num_heads, head_dim), k.view(T, num_kv_heads, head_dim)   # strided views
    positions = torch.randint(0, 256, (T,), device=DEVICE)
    q_norm = RMSNorm(head_dim).to(DEVICE, dtype)
    k_norm = RMSNorm(head_dim).to(DEVICE, dtype)
    q_norm.weight.copy_(1 + 0.1 * torch.randn(head_dim))
    k_norm.weight.copy_(1 + 0.1 * torch.randn(head_dim))

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        qq, kk = (q_norm(q), k_norm(k)) if qk_norm else (q, k)
        if dtype == torch.bfloat16:   # the kernel rotates in float32 with float32 cos/sin
            qq, kk = qq.float(), kk.float()
        rope._rows = None
        qr, kr = rope(positions, qq, kk)
        return qr.to(dtype), kr.to(dtype)

    ref_q, ref_k = _torch_path(reference)
    got_q, got_k = triton_ops.qk_norm_rope(
        q, k, q_norm.weight if qk_norm else None, k_norm.weight if qk_norm else None, 1e-6,
        rope.cos_cache, rope.sin_cache, positions)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    torch.testing.assert_close(got_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(got_k, ref_k, **TOL[dtype])


# -- fused matrix-vector kernels (fused.set_gemv) -----------------------------------------------

def _tiny_qwen3(seed: int) -> torch.nn.Module:
    """A 2-layer float32 Qwen3 of ours with random weights (norm weights around 1)."""
    from transformers import Qwen3Config

    from omnistage.models.config import ModelConfig
    from omnistage.models.qwen3 import Qwen3ForCausalLM

    hf = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=128, max_position_embeddings=64,
                     architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(ModelConfig.from_hf(hf)).to(DEVICE, torch.float32)
    for p in model.parameters():
        p.data.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model


@pytest.fixture
def gemv_on():
    fused.set_gemv(True)
    fused._interpret = DEVICE.type == "cpu"
    yield
    fused.set_gemv(True)              # the default
    fused.set_gemv_rows(None)
    fused._interpret = False


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_linear(gemv_on, dtype: torch.dtype, rows: int, with_residual: bool,
                     bias: bool) -> None:
    """K = 300 (a partial K tile), N = 37 (a partial N block); one row (CUDA cores) or several
    (tensor cores, rows padded to 16)."""
    from omnistage.layers.linear import Linear

    torch.manual_seed(4)
    norm = RMSNorm(300, eps=1e-6).to(DEVICE, dtype)
    norm.weight.copy_(1 + 0.1 * torch.randn(300))
    linear = Linear(300, 37, bias=bias).to(DEVICE, dtype)
    linear.weight.copy_(torch.randn(37, 300) * 0.05)
    if bias:
        linear.bias.copy_(torch.randn(37))
    x = torch.randn(rows, 300).to(DEVICE, dtype)
    residual = torch.randn(rows, 300).to(DEVICE, dtype) if with_residual else None

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return linear(norm(x)), x
        normed, total = norm.add_forward(x, residual)
        return linear(normed), total

    fused.set_gemv(False)
    want, want_total = _torch_path(reference)
    fused.set_gemv(True)
    from omnistage.layers import triton_gemv      # the kernel itself (fused.* routes 1 row)

    got, got_total = triton_gemv.norm_linear(x, residual, norm.weight, norm.eps, linear.weight,
                                             linear.bias)
    assert got.shape == (rows, 37)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got_total, want_total, atol=0, rtol=0)


@kernel_test
@pytest.mark.parametrize("faster", [False, True])
def test_lm_head_takes_the_kernel_only_where_faster(gemv_on, monkeypatch: pytest.MonkeyPatch,
                                                    faster: bool) -> None:
    """fused.lm_head: one row through the matrix-vector kernel where that measured faster
    (faked here), else the module; the same logits either way (float32)."""
    from omnistage.layers import triton_gemv
    from omnistage.layers.linear import Linear

    torch.manual_seed(3)
    head = Linear(48, 200).to(DEVICE)
    head.weight.data.normal_(0, 0.1)
    x = torch.randn(1, 48, device=DEVICE)
    calls = []
    real = triton_gemv.linear
    monkeypatch.setattr(triton_gemv, "lm_head_faster_here", lambda t: faster)
    monkeypatch.setattr(triton_gemv, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = fused.lm_head(head, x)
    assert len(calls) == int(faster)
    torch.testing.assert_close(got, x @ head.weight.T, atol=1e-5, rtol=1e-5)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_silu_linear(gemv_on, dtype: torch.dtype, rows: int) -> None:
    from omnistage.layers.linear import Linear

    torch.manual_seed(5)
    act = SiluAndMul()
    linear = Linear(300, 21).to(DEVICE, dtype)
    linear.weight.copy_(torch.randn(21, 300) * 0.05)
    x = torch.randn(rows, 600).to(DEVICE, dtype)
    fused.set_gemv(False)
    want = _torch_path(lambda: linear(act(x)))
    fused.set_gemv(True)
    from omnistage.layers import triton_gemv

    torch.testing.assert_close(triton_gemv.silu_linear(x, linear.weight, linear.bias), want,
                               **TOL[dtype])


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_linear(gemv_on, dtype: torch.dtype, rows: int) -> None:
    """Plain x W^T + b: several rows padded to 16 inside, K = 300, N = 37."""
    from omnistage.layers.linear import Linear

    torch.manual_seed(6)
    linear = Linear(300, 37, bias=True).to(DEVICE, dtype)
    linear.weight.copy_(torch.randn(37, 300) * 0.05)
    linear.bias.copy_(torch.randn(37))
    x = torch.randn(rows, 300).to(DEVICE, dtype)
    fused.set_gemv(False)
    want = _torch_path(lambda: linear(x))
    fused.set_gemv(True)
    from omnistage.layers import triton_gemv

    torch.testing.assert_close(triton_gemv.linear(x, linear.weight, linear.bias), want,
                               **TOL[dtype])


@kernel_test
@pytest.mark.parametrize("kind", ["linear", "norm_linear", "silu_linear", "per_tensor"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_8bit_weights_through_the_matrix_vector_kernel(gemv_on, monkeypatch: pytest.MonkeyPatch,
                                                       kind: str, rows: int,
                                                       method: str) -> None:
    """An Fp8Linear's or Int8Linear's one-row product through fused.* reads its 8-bit weight
    with its scales (W8A16): equal, up to float32
    summation order, to the activations times the dequantized weight, plus the bias; the
    per-tensor scale of an FP8 checkpoint too. Not the W8A8 paths (torch._scaled_mm,
    torch._int_mm): they are not taken."""
    from omnistage.layers import int8
    from omnistage.layers.fp8 import Fp8Linear
    from omnistage.layers.linear import Linear

    if method == "int8" and kind == "per_tensor":
        pytest.skip("INT8 weights come quantized at load, one scale per channel")
    eight_bit = int8.Int8Linear if method == "int8" else Fp8Linear
    monkeypatch.setattr(int8, "int8_matmul", lambda *a: pytest.fail("W8A8 path taken"))

    torch.manual_seed(8)
    dtype = DTYPES[-1]
    k = 600 if kind == "silu_linear" else 300
    dense = Linear(k // 2 if kind == "silu_linear" else k, 40, bias=True).to(DEVICE, dtype)
    dense.weight.data.normal_(0, 0.05)
    dense.bias.data.normal_(0, 1.0)
    layer = eight_bit.from_linear(dense)
    if kind == "per_tensor":     # one scale (as a checkpoint may give), the weight re-scaled
        layer.weight_scale = layer.weight_scale.amax().reshape(())
    weight = layer.weight.float() * layer.weight_scale.reshape(-1, 1).float()    # (N, K)
    bias = layer.bias.float()
    fused.set_gemv_rows(rows)                        # several rows: the tensor-core variant
    x = torch.randn(rows, k).to(DEVICE, dtype)
    norm = RMSNorm(k, eps=1e-5).to(DEVICE, dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    if kind == "norm_linear":
        got, _ = fused.norm_linear(norm, layer, x, None)
        inputs = norm(x).float()
    elif kind == "silu_linear":
        got = fused.silu_linear(SiluAndMul(), layer, x)
        inputs = SiluAndMul()(x).float()
    else:
        got = fused.linear(layer, x)
    if kind in ("linear", "per_tensor"):
        inputs = x.float()
    want = inputs @ weight.T + bias
    assert want.abs().mean() > 0.5                  # a product of meaningful size
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@kernel_test
def test_packed_int8_weights_decode_every_code_exactly(gemv_on) -> None:
    """One row reads an INT8 weight four to a word and widens the bytes by shifts
    (triton_gemv.packing / _byte_plane): every code, at each of a word's four byte positions,
    comes out exactly; and whole products equal the unpacked path's up to float32 summation
    order."""
    from omnistage.layers import triton_gemv

    codes = torch.arange(-127, 128, dtype=torch.int16).to(torch.int8)
    n = codes.numel()
    weight = torch.zeros(n, 8, dtype=torch.int8)
    weight[torch.arange(n), torch.arange(n) % 8] = codes        # every byte position of a word
    weight = weight.to(DEVICE)
    assert triton_gemv.packing(weight, 1) and not triton_gemv.packing(weight, 2)
    ones, scale = torch.ones(1, 8, device=DEVICE), torch.ones(n, device=DEVICE)
    got = triton_gemv.linear(ones, weight, scale=scale)
    torch.testing.assert_close(got, codes.to(DEVICE).float()[None, :], rtol=0, atol=0)

    torch.manual_seed(3)
    wq = (torch.randn(96, 520, device=DEVICE) * 3).round().clamp(-127, 127).to(torch.int8)
    scale = torch.rand(96, device=DEVICE) + 0.5
    x = torch.randn(1, 520, device=DEVICE)
    want = x @ (wq.float() * scale[:, None]).T
    assert want.abs().mean() > 10.0
    cfg = dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=1)
    for packed in (True, False):
        got = triton_gemv._launch(x, None, None, 0.0, wq, None, False, 520,
                                  {**cfg, "PACKED": packed}, scale)[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)      # float32 sums


@kernel_test
@pytest.mark.parametrize("limit", [None, 1, 8])
def test_rows_taking_the_kernel(gemv_on, monkeypatch: pytest.MonkeyPatch,
                                limit: int | None) -> None:
    """fused.linear takes the kernel for up to set_gemv_rows rows (None: triton_gemv.max_rows,
    one row on a GPU not measured faster, and on CPU); more rows take the module; the same
    products either way."""
    from omnistage.layers import triton_gemv
    from omnistage.layers.linear import Linear

    fused.set_gemv_rows(limit)
    torch.manual_seed(9)
    lin = Linear(64, 48).to(DEVICE)
    lin.weight.data.normal_(0, 0.1)
    calls: list[int] = []
    real = triton_gemv._launch
    monkeypatch.setattr(triton_gemv, "_launch",
                        lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    most = limit or triton_gemv.max_rows(torch.empty(1, device=DEVICE))
    for rows in (1, 2, 8, 9):
        x = torch.randn(rows, 64, device=DEVICE)
        torch.testing.assert_close(fused.linear(lin, x), x @ lin.weight.T, atol=1e-5,
                                   rtol=1e-5)
    assert calls == [r for r in (1, 2, 8, 9) if r <= most]


@kernel_test
def test_decoder_with_gemv_equals_without(gemv_on, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 forward pass of 1 row (a single-stream decode: the fused kernels) and of 9 rows
    (the usual path) with set_gemv on equals it with set_gemv off."""
    from omnistage.layers.attention import AttentionMetadata, TorchPagedAttention, \
        forward_context

    model = _tiny_qwen3(seed=6)
    from omnistage.layers import triton_gemv

    calls: list[int] = []
    real = triton_gemv._launch

    def counted(x, *args, **kw):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return real(x, *args, **kw)

    monkeypatch.setattr(triton_gemv, "_launch", counted)
    for num_tokens in (1, 9):
        ids = torch.randint(0, 128, (num_tokens,), device=DEVICE)
        positions = torch.arange(num_tokens, device=DEVICE)
        md = AttentionMetadata(
            slot_mapping=positions, query_start_loc=torch.tensor([0, num_tokens], device=DEVICE,
                                                                 dtype=torch.int32),
            seq_lens=torch.tensor([num_tokens], device=DEVICE, dtype=torch.int32),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
            query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens],
            max_query_len=num_tokens, max_seq_len=num_tokens)

        def forward() -> torch.Tensor:
            for layer in model.modules():
                if hasattr(layer, "backend"):
                    layer.backend = TorchPagedAttention()
            md.backend_state = None
            with forward_context(md), torch.no_grad():
                return model(ids, positions)[0]

        fused.set_gemv(False)
        want = forward()
        fused.set_gemv(True)
        torch.testing.assert_close(forward(), want, atol=1e-5, rtol=1e-5)
    assert calls == [1] * 8   # 2 layers x (norm + qkv, o, norm + gate_up, silu + down); 9: none


# -- q/k norm + rotary + K/V cache store in one kernel -----------------------------------------

def _paged_forward(model: torch.nn.Module, ids: torch.Tensor, chunks: list[tuple],
                   fused_ops: bool) -> list[torch.Tensor]:
    """One sequence through `model` in chunks (start, end, positions) over the Triton paged
    attention (block size 4, pages scattered), from empty caches, with the fused kernels on or
    off -> each chunk's output, then every layer's K and V cache."""
    from omnistage.layers.attention import Attention, AttentionMetadata, forward_context
    from omnistage.layers.triton_attention import TritonPagedAttention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    num_kv_heads, head_dim = layers[0].num_kv_heads, layers[0].head_dim
    backend = TritonPagedAttention(4, layers[0].num_heads // num_kv_heads, num_kv_heads,
                                   num_sms=1)
    for layer in layers:
        layer.backend = backend
        layer.k_cache = torch.zeros(6, 4, num_kv_heads, head_dim, device=DEVICE)
        layer.v_cache = torch.zeros(6, 4, num_kv_heads, head_dim, device=DEVICE)
    table = torch.tensor([[3, 0, 5]], dtype=torch.int32, device=DEVICE)
    outs = []
    fused._interpret = fused_ops      # on CPU: the kernels run in Triton's interpreter
    fused._enabled = fused_ops        # on CUDA: off means the PyTorch ops
    fused.set_layer_kernel(False)     # decodes too take the per-op kernels tested here
    try:
        for start, end, positions in chunks:
            flat = torch.arange(start, end, device=DEVICE)
            md = AttentionMetadata(
                slot_mapping=table[0, flat // 4].long() * 4 + flat % 4,
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32,
                                             device=DEVICE),
                seq_lens=torch.tensor([end], dtype=torch.int32, device=DEVICE),
                block_tables=table, query_start_loc_cpu=[0, end - start], seq_lens_cpu=[end],
                max_query_len=end - start, max_seq_len=end)
            backend.prepare(md, has_cache=True)
            with forward_context(md), torch.no_grad():
                outs.append(model(ids[start:end], positions)[0])
    finally:
        fused._interpret, fused._enabled = False, True
        fused.set_layer_kernel(None)
    return outs + [t for layer in layers for t in (layer.k_cache, layer.v_cache)]


@kernel_test
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_equals_rope_then_store(qk_norm: bool) -> None:
    from omnistage.layers.triton_attention import store_kv

    torch.manual_seed(7)
    num_heads, num_kv_heads, head_dim, T = 4, 2, 16, 5
    rope = get_rope(head_dim, 64, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = q.view(T, num_heads, head_dim)
    k, v = k.view(T, num_kv_heads, head_dim), v.view(T, num_kv_heads, head_dim)
    positions = torch.tensor([3, 4, 5, 9, 0], device=DEVICE)
    slots = torch.tensor([7, 2, -1, 12, 0], device=DEVICE)          # -1: a padding row
    qw = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)) if qk_norm else None
    kw = (1 + 0.1 * torch.randn(head_dim, device=DEVICE)) if qk_norm else None
    caches = [torch.full((4, 4, num_kv_heads, head_dim), 5.0, device=DEVICE) for _ in range(4)]
    ref_q, ref_k = triton_ops.qk_norm_rope(q, k, qw, kw, 1e-6, rope.cos_cache, rope.sin_cache,
                                           positions)
    store_kv(ref_k, v, caches[0], caches[1], slots)
    got_q = triton_ops.qk_norm_rope_store(q, k, v, qw, kw, 1e-6, rope.cos_cache,
                                          rope.sin_cache, positions, None, caches[2],
                                          caches[3], slots)
    assert torch.equal(got_q, ref_q)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert (caches[2] == 5.0).sum() == caches[2].numel() - 4 * num_kv_heads * head_dim


@kernel_test
def test_decoder_with_fused_kv_store_equals_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 model over the Triton paged attention: prefill then two decodes with every
    fused kernel (q/k norm + rotary writing the cache itself) equal the PyTorch ops with the
    attention's own K/V store; the caches end up equal too."""
    model = _tiny_qwen3(seed=8)
    ids = torch.randint(0, 128, (11,), device=DEVICE)
    chunks = [(start, end, torch.arange(start, end, device=DEVICE))
              for start, end in ((0, 9), (9, 10), (10, 11))]

    calls: list[int] = []
    real = triton_ops.qk_norm_rope_store
    monkeypatch.setattr(triton_ops, "qk_norm_rope_store",
                        lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    want = _paged_forward(model, ids, chunks, fused_ops=False)
    assert calls == []
    got = _paged_forward(model, ids, chunks, fused_ops=True)
    assert calls == [9, 9, 1, 1, 1, 1]          # 2 layers x (prefill, decode, decode)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@kernel_test
@pytest.mark.parametrize("interleaved, section", [(True, (3, 3, 2)), (False, (4, 2, 2))])
@pytest.mark.parametrize("layout", ["3xT", "3xT strided", "T"])
def test_qk_norm_mrope(interleaved: bool, section: tuple, layout: str) -> None:
    """M-RoPE (Qwen3-Omni) in the fused kernel: each frequency's angle from its axis's
    position row, positions (3, T) (also a view of a wider buffer, as the CUDA graphs pass
    them) or (T,); with the K/V store variant too."""
    from omnistage.layers.mrope import MRotaryEmbedding
    from omnistage.layers.triton_attention import store_kv

    torch.manual_seed(9)
    num_heads, num_kv_heads, head_dim, T = 4, 2, 16, 6
    rope = MRotaryEmbedding(head_dim, 128, {"rope_type": "default", "rope_theta": 10000.0},
                            section, interleaved=interleaved).to(DEVICE)
    qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = q.view(T, num_heads, head_dim)
    k, v = k.view(T, num_kv_heads, head_dim), v.view(T, num_kv_heads, head_dim)
    wide = torch.randint(0, 128, (3, T + 5), device=DEVICE)
    positions = {"3xT": wide[:, :T].contiguous(), "3xT strided": wide[:, :T],
                 "T": wide[0, :T]}[layout]
    q_norm, k_norm = RMSNorm(head_dim).to(DEVICE), RMSNorm(head_dim).to(DEVICE)
    q_norm.weight.copy_(1 + 0.1 * torch.randn(head_dim))
    k_norm.weight.copy_(1 + 0.1 * torch.randn(head_dim))

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        rope._rows = None
        return rope(positions, q_norm(q), k_norm(k))

    ref_q, ref_k = _torch_path(reference)
    args = (q_norm.weight, k_norm.weight, 1e-6, rope.cos_cache, rope.sin_cache, positions,
            rope.axis)
    got_q, got_k = triton_ops.qk_norm_rope(q, k, *args)
    torch.testing.assert_close(got_q, ref_q, **TOL[torch.float32])
    torch.testing.assert_close(got_k, ref_k, **TOL[torch.float32])
    slots = torch.arange(T, device=DEVICE) * 2
    caches = [torch.zeros(4, 4, num_kv_heads, head_dim, device=DEVICE) for _ in range(4)]
    store_kv(got_k, v, caches[0], caches[1], slots)
    stored_q = triton_ops.qk_norm_rope_store(q, k, v, *args, caches[2], caches[3], slots)
    assert torch.equal(stored_q, got_q)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@kernel_test
def test_qwen3_omni_thinker_with_fused_kernels_equals_unfused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-Omni's thinker (M-RoPE, MoE) over the Triton attention, a prefill with distinct
    t/h/w positions then a decode: every fused kernel (norms, SiLU, q/k norm + M-RoPE writing
    the K/V cache) equals the PyTorch ops with the attention's own K/V store."""
    from omnistage.models.qwen3_omni.thinker import Qwen3OmniThinkerForCausalLM
    from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

    path = build_tiny_qwen3_omni(tmp_path / "omni", with_processor=False)
    model = Qwen3OmniThinkerForCausalLM.from_pretrained(path).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (8,), generator=gen).to(DEVICE)
    positions = torch.stack([torch.tensor([0, 1, 2, 2, 2, 2, 4, 5]),
                             torch.tensor([0, 1, 2, 2, 3, 3, 4, 5]),
                             torch.tensor([0, 1, 2, 3, 2, 3, 4, 5])]).to(DEVICE)
    chunks = [(0, 7, positions[:, :7].contiguous()), (7, 8, positions[:, 7:].contiguous())]
    num_layers = model.config.model.num_hidden_layers

    calls: list[tuple] = []
    real = triton_ops.qk_norm_rope_store
    monkeypatch.setattr(triton_ops, "qk_norm_rope_store",
                        lambda q, *a: calls.append((q.shape[0], a[-4] is not None)) or
                        real(q, *a))
    want = _paged_forward(model, ids, chunks, fused_ops=False)
    got = _paged_forward(model, ids, chunks, fused_ops=True)
    assert calls == [(7, True)] * num_layers + [(1, True)] * num_layers   # M-RoPE axis given
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_dit_norm_modulate_gated_add_rope(dtype: torch.dtype) -> None:
    """A DiT block's elementwise chains (Wan): LayerNorm with and without affine, modulated
    per row and per token; the gated residual; the interleaved rotation of every head."""
    from omnistage.layers.dit import apply_complex_rope

    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(DEVICE)

    x = (3 * rand(2, 7, 48) + 1).to(dtype)
    w, b = 1 + rand(48, scale=0.1), rand(48, scale=0.1)
    for s in (1, 7):                                     # per row, per token
        scale, shift = rand(2, s, 48, scale=0.3), rand(2, s, 48)
        normed = torch.nn.functional.layer_norm(x.float(), (48,), eps=1e-6)
        want = torch.addcmul(shift, normed, 1 + scale).to(dtype)
        torch.testing.assert_close(triton_ops.norm_modulate(x, 1e-6, None, None, scale, shift),
                                   want, **TOL[dtype])
        gate, y = rand(2, s, 48), rand(2, 7, 48).to(dtype)
        torch.testing.assert_close(triton_ops.gated_add(x, y, gate),
                                   torch.addcmul(x, y, gate).to(dtype), **TOL[dtype])
    affine = torch.nn.functional.layer_norm(x.float(), (48,), w, b, eps=1e-6).to(dtype)
    torch.testing.assert_close(triton_ops.norm_modulate(x, 1e-6, w, b), affine, **TOL[dtype])
    q = rand(2, 7, 3, 12).to(dtype)                     # (B, N, H, hd)
    angles = rand(7, 6, scale=3.0)
    want = apply_complex_rope(q, torch.polar(torch.ones_like(angles), angles))
    torch.testing.assert_close(triton_ops.rope_pairs(q, angles.cos(), angles.sin()), want,
                               **TOL[dtype])


@kernel_test
def test_wan_transformer_with_fused_kernels_equals_unfused(tmp_path: Path) -> None:
    """The tiny Wan transformer (per-token timesteps too): its norms, modulation, gated
    residuals and rope as the fused kernels equal the PyTorch ops."""
    import diffusers

    from omnistage.models.wan_transformer import WanTransformer3DModel

    torch.manual_seed(0)
    diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2
    ).save_pretrained(tmp_path)
    model = WanTransformer3DModel.from_pretrained(tmp_path, DEVICE)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 2, 4, 6, generator=gen).to(DEVICE)
    text = torch.randn(2, 5, 16, generator=gen).to(DEVICE)
    for t in (torch.tensor([900, 20]), torch.tensor([[700] * 12, [0] * 6 + [700] * 6])):
        want = _torch_path(lambda: model(x, t.to(DEVICE), text))
        fused._interpret = DEVICE.type == "cpu"
        try:
            got = model(x, t.to(DEVICE), text)
        finally:
            fused._interpret = False
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _fused_equals_unfused(model: torch.nn.Module, run, monkeypatch: pytest.MonkeyPatch,
                          calls: dict[str, int]) -> None:  # type: ignore[no-untyped-def]
    """model's run() with the DiT kernels (in Triton's interpreter on CPU) equals its PyTorch
    path, each kernel launched as often as `calls` says; the parameters drawn at a scale
    where every branch moves the output."""
    launched = dict.fromkeys(calls, 0)

    def counting(name: str):  # type: ignore[no-untyped-def]
        kernel = getattr(triton_ops, name)

        def counted(*args):  # type: ignore[no-untyped-def]
            launched[name] += 1
            return kernel(*args)
        return counted

    for name in calls:
        monkeypatch.setattr(triton_ops, name, counting(name))
    gen = torch.Generator(DEVICE).manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2, generator=gen)
        want = _torch_path(run)
        fused._interpret = DEVICE.type == "cpu"
        try:
            got = run()
        finally:
            fused._interpret = False
    assert launched == calls, launched
    assert want.abs().mean() > 0.1, want.abs().mean()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@kernel_test
def test_qwen_image_transformer_with_fused_kernels_equals_unfused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen-Image (Edit-2511's per-token modulation, a condition image, a text mask): its
    adaptive norms, gated residuals and rope (a complex table's strided halves) as kernels."""
    from omnistage.models.qwen_image_transformer import (QwenImageTransformer2DModel,
                                                         QwenImageTransformerConfig)

    model = QwenImageTransformer2DModel(QwenImageTransformerConfig(
        in_channels=8, out_channels=2, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=8, axes_dims_rope=(2, 2, 4),
        zero_cond_t=True)).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    img = torch.randn(2, 6 + 4, 8, generator=gen).to(DEVICE)       # a 2x3 target, 2x2 condition
    txt = torch.randn(2, 3, 8, generator=gen).to(DEVICE)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], device=DEVICE)
    t = torch.tensor([0.9, 0.3], device=DEVICE)
    _fused_equals_unfused(model, lambda: model(img, txt, mask, t, [[(1, 2, 3), (1, 2, 2)]] * 2),
                          monkeypatch, {"norm_modulate": 5, "gated_add": 4, "rms_norm_rope_pairs": 4})


@kernel_test
def test_flux_transformer_with_fused_kernels_equals_unfused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUX.1 (a double and a single block): adaptive norms, gated residuals, the rope of its
    pair-repeated tables read every other column, the output norm."""
    from omnistage.models.flux_transformer import FluxTransformer2DModel, FluxTransformerConfig

    model = FluxTransformer2DModel(FluxTransformerConfig(
        in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4))).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    img = torch.randn(2, 6, 8, generator=gen).to(DEVICE)
    txt = torch.randn(2, 3, 8, generator=gen).to(DEVICE)
    pooled = torch.randn(2, 8, generator=gen).to(DEVICE)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(2.0), torch.arange(3.0),
                                         indexing="ij"), -1).reshape(6, 3).to(DEVICE)
    txt_ids = torch.tensor([[0.0, 1, 2], [1, 0, 3], [2, 2, 0]], device=DEVICE)   # not all 0:
    # a table row given to the wrong stream must show
    t = torch.tensor([0.9, 0.3], device=DEVICE)
    _fused_equals_unfused(model, lambda: model(img, txt, pooled, t, img_ids, txt_ids),
                          monkeypatch, {"norm_modulate": 6, "gated_add": 5, "rms_norm_rope_pairs": 6})


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_fp8_equals_torch(dtype: torch.dtype) -> None:
    """FP8 activations (layers/fp8.py): the one-pass kernel gives the PyTorch form's bytes and
    scales exactly, rows of magnitudes 1e-2 .. 1e2, a width that is no power of two, a
    strided input and an all-zero row. Triton's interpreter converts to e4m3 by its own
    emulation, which rounds values just under a power of two down a binade (-1.97 -> -1.0):
    there only the scales are compared; the bytes on a GPU."""
    from omnistage.layers.fp8 import FP8, FP8_MAX, quantize_rows

    gen = torch.Generator().manual_seed(0)
    magnitude = torch.logspace(-2, 2, 9)[torch.randperm(9, generator=gen)]
    x = (torch.randn(9, 200, generator=gen) * magnitude[:, None]).to(DEVICE, dtype)
    x[4] = 0
    for rows in (x, x[:, :144]):
        q, scale = triton_ops.quantize_rows_fp8(rows, FP8, FP8_MAX)
        want_q, want_scale = quantize_rows(rows)
        assert torch.equal(scale, want_scale)
        if DEVICE.type == "cuda":
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rope_pairs(dtype: torch.dtype) -> None:
    """A DiT's q/k RMSNorm + interleaved rope in one kernel (Qwen-Image, FLUX): heads and
    pairs that are no powers of two, tables as a complex table's strided .real / .imag."""
    from omnistage.layers.dit import apply_complex_rope

    gen = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(2, 5, 3, 12, generator=gen)).to(DEVICE, dtype)   # (B, N, H, hd)
    weight = (1 + 0.1 * torch.randn(12, generator=gen)).to(DEVICE, dtype)
    table = torch.polar(torch.ones(5, 6), 3 * torch.randn(5, 6, generator=gen)).to(DEVICE)
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
              * weight.float())
    want = apply_complex_rope(normed, table).to(dtype)
    got = triton_ops.rms_norm_rope_pairs(x, weight, 1e-6, table.real, table.imag)
    torch.testing.assert_close(got, want, **TOL[dtype])
