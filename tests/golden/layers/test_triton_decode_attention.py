"""The one-kernel attention of small decode batches (triton_decode_attention.py) against the
separate kernels it replaces (q/k norm + rotary + K/V store, split-K attention, combine) and
the PyTorch reference: float32, outputs within 2e-5, the same caches. Without a GPU the
kernels run in Triton's interpreter in a child process (tests/gpu adds bf16 engines)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from omnistage.layers import fused  # noqa: E402
from omnistage.layers.attention import (Attention, TorchPagedAttention,  # noqa: E402
                                        forward_context)
from omnistage.layers.norm import RMSNorm  # noqa: E402
from omnistage.layers.rotary import get_rope  # noqa: E402
from omnistage.layers.triton_attention import TritonPagedAttention  # noqa: E402
from omnistage.testing.attention import mixed_batch_metadata  # noqa: E402
from omnistage.testing.interpreter import (INTERPRETING, patch_interpreter,  # noqa: E402
                                           run_in_interpreter)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_HERE = torch.cuda.is_available() or INTERPRETING
kernel_test = pytest.mark.skipif(not KERNELS_HERE, reason="runs in the interpreter child")

if DEVICE.type == "cpu" and KERNELS_HERE:
    patch_interpreter()

H, HKV, D, PAGE = 4, 2, 16, 8


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    run_in_interpreter(__file__)


@pytest.fixture
def interpret():
    fused._interpret = DEVICE.type == "cpu"
    fused.set_decode_attention(True)
    yield
    fused._interpret = False
    fused.set_decode_attention(None)           # the default


def _layer(qk_norm: bool, seed: int) -> Attention:
    torch.manual_seed(seed)
    attn = Attention(H, D, HKV)
    attn.rope = get_rope(D, 512, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    attn.q_norm = attn.k_norm = None
    if qk_norm:
        attn.q_norm, attn.k_norm = RMSNorm(D).to(DEVICE), RMSNorm(D).to(DEVICE)
        attn.q_norm.weight.data.uniform_(0.5, 1.5)
        attn.k_norm.weight.data.uniform_(0.5, 1.5)
    return attn


def _steps(attn: Attention, backend, contexts: list[int], pads: int, steps: int,
           seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """`steps` decode steps of sequences with these cached lengths (plus `pads` CUDA-graph
    padding rows: slot -1, length 0) through attn with this backend; -> each step's output,
    and the caches (seeded: the same data for every backend)."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-(max(contexts) + steps) // PAGE)
    num_blocks = len(contexts) * width + 2
    attn.k_cache = torch.randn(num_blocks, PAGE, HKV, D, generator=gen).to(DEVICE)
    attn.v_cache = torch.randn(num_blocks, PAGE, HKV, D, generator=gen).to(DEVICE)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(width)] for _ in contexts]
    attn.backend = backend
    outs = []
    for step in range(steps):
        lens = [c + step for c in contexts]
        slots = [t[p // PAGE] * PAGE + p % PAGE for t, p in zip(tables, lens)]
        md = mixed_batch_metadata([(c, 1) for c in lens] + [(0, 1)] * pads,
                                  tables + [tables[0]] * pads, slots + [-1] * pads, DEVICE)
        md.seq_lens[len(lens):] = 0                       # padding rows attend to nothing
        n = len(lens) + pads
        step_gen = torch.Generator().manual_seed(seed * 100 + step)   # real rows: as pads=0
        qkv = torch.cat([torch.randn(len(lens), (H + 2 * HKV) * D, generator=step_gen),
                         torch.randn(pads, (H + 2 * HKV) * D)]).to(DEVICE)
        q, k, v = qkv.split([H * D, HKV * D, HKV * D], dim=-1)   # strided views, as models
        positions = torch.tensor(lens + [0] * pads, device=DEVICE)
        backend.prepare(md, has_cache=True)
        with forward_context(md):
            outs.append(attn.rotate_and_attend(attn.rope, positions, q.view(n, H, D),
                                               k.view(n, HKV, D), v.view(n, HKV, D),
                                               attn.q_norm, attn.k_norm))
    return outs, attn.k_cache, attn.v_cache


@kernel_test
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("num_sms,contexts,block_t", [
    (64, [300, 129, 4, 0], None),   # up to 8 slices of 128-key tiles: 3, 2, 1 in use, empty
                                    # ones, a first token (nothing cached)
    (64, [300, 129, 4, 0], 16),     # 8 slices of 3 16-key tiles: the next tile in flight
    (8, [70], None),                # 4 slices
    (16, [140, 3], 16),             # 2 slices over two sequences
])
def test_fused_decode_equals_separate_kernels(interpret, monkeypatch, qk_norm: bool,
                                              num_sms: int, contexts: list[int],
                                              block_t: int | None) -> None:
    """Three decode steps (the slices' counters must be ready again for the next launch),
    with a padding row: the fused kernel's outputs and caches against the separate kernels'
    and the PyTorch backend's. block_t: keys a tile, if not the default."""
    from omnistage.layers import triton_decode_attention

    if block_t is not None:
        monkeypatch.setattr(triton_decode_attention, "BLOCK_T", block_t)
    attn = _layer(qk_norm, seed=0)
    fused_backend = TritonPagedAttention(PAGE, H // HKV, HKV, num_sms=num_sms)
    calls = []
    kernel = fused_backend._decode

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[-1])                                 # the slices
        return kernel(*args, **kwargs)
    fused_backend._decode = counted       # type: ignore[assignment]
    got, got_k, got_v = _steps(attn, fused_backend, contexts, 1, 3, seed=5)
    assert len(calls) == 3 and min(calls) > 1                  # the fused kernel, split
    fused.set_decode_attention(False)
    want, want_k, want_v = _steps(attn, TritonPagedAttention(PAGE, H // HKV, HKV,
                                                             num_sms=num_sms),
                                  contexts, 1, 3, seed=5)
    fused._interpret = False                                   # the PyTorch path
    ref, ref_k, ref_v = _steps(attn, TorchPagedAttention(PAGE), contexts, 0, 3, seed=5)
    n = len(contexts)
    for g, w, r in zip(got, want, ref):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(g[:n], r[:n], atol=2e-5, rtol=2e-5)
        assert torch.equal(g[n:], torch.zeros_like(g[n:]))    # padding: zeros
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_v, want_v, atol=0, rtol=0)
    torch.testing.assert_close(got_k, ref_k, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_v, ref_v, atol=0, rtol=0)
    assert not kernel.counts(DEVICE, 1).any()                  # left at zero


@kernel_test
def test_not_taken_where_it_does_not_apply(interpret) -> None:
    """No split (a batch that fills the device) or a prefill in the batch: the separate
    kernels run (rotate_and_attend returns None)."""
    attn = _layer(True, seed=1)
    backend = TritonPagedAttention(PAGE, H // HKV, HKV, num_sms=2)      # 2 programs: no split
    calls = []
    kernel = backend._decode
    backend._decode = lambda *a, **k: calls.append(1) or kernel(*a, **k)  # type: ignore
    _steps(attn, backend, [30, 5], 0, 1, seed=2)
    assert calls == []
    md = mixed_batch_metadata([(0, 3), (4, 1)], [[0], [1]], [0, 1, 2, 12], DEVICE)
    backend = TritonPagedAttention(PAGE, H // HKV, HKV, num_sms=64)
    backend.prepare(md, has_cache=True)
    q = torch.randn(4, H, D, device=DEVICE)
    kv = torch.randn(4, HKV, D, device=DEVICE)
    args = (None, None, 1e-6, attn.rope.cos_cache, attn.rope.sin_cache,
            torch.arange(4, device=DEVICE), None)
    assert backend.rotate_and_attend(q, kv, kv, args, attn.k_cache, attn.v_cache, md,
                                     0.25) is None
