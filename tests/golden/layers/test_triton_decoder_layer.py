"""The one-kernel-a-layer path of one-row decode steps (triton_decoder_layer.py) against the
per-op kernels, layer by layer, on tiny Qwen3 and Qwen2 models over the paged cache. On a GPU
the grid is one program per multiprocessor (tests/gpu has the real-size checks); without one
the kernel runs in Triton's interpreter in a child process, with a grid of one program (its
barriers cannot wait for programs the interpreter runs later), tiles cut as for several
programs and the attention split into slices, so that every loop of the kernel runs."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from omnistage.testing.interpreter import (INTERPRETING, patch_interpreter,  # noqa: E402
                                           run_in_interpreter)

from omnistage.layers import fused  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNELS_HERE = torch.cuda.is_available() or INTERPRETING
kernel_test = pytest.mark.skipif(not KERNELS_HERE, reason="runs in the interpreter child")
PAGE = 4

if DEVICE.type == "cpu" and KERNELS_HERE:
    patch_interpreter()


@pytest.mark.skipif(KERNELS_HERE, reason="the kernels run in this process")
def test_kernels_in_triton_interpreter() -> None:
    """Re-run this file with TRITON_INTERPRET=1 in a child process (CPU only)."""
    run_in_interpreter(__file__)


def _tiny(kind: str, seed: int) -> torch.nn.Module:
    """A 2-layer float32 Qwen3 (q/k norm) or Qwen2 (q/k/v bias) with random weights."""
    from transformers import Qwen2Config, Qwen3Config

    from omnistage.models.config import ModelConfig
    from omnistage.models.qwen2 import Qwen2ForCausalLM
    from omnistage.models.qwen3 import Qwen3ForCausalLM

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=64)
    if kind == "qwen3":
        hf, cls = Qwen3Config(head_dim=16, **common, architectures=["Qwen3ForCausalLM"]), \
            Qwen3ForCausalLM
    else:
        hf, cls = Qwen2Config(**common, architectures=["Qwen2ForCausalLM"]), Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(ModelConfig.from_hf(hf)).to(DEVICE, torch.float32)
    for p in model.parameters():
        p.data.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model


def _run(model: torch.nn.Module, ids: torch.Tensor, steps: list[tuple[int, int]],
         layer_kernel: bool, stack_args: dict) -> list[torch.Tensor]:
    """A sequence through the model in steps (start, end) over a fresh paged cache (pages
    scattered), the fused kernels on, one-row steps by the layer kernel or not -> each step's
    hidden states, then every layer's K and V cache."""
    from omnistage.layers import triton_decoder_layer as tdl
    from omnistage.layers.attention import Attention, forward_context
    from omnistage.layers.triton_attention import TritonPagedAttention
    from omnistage.testing.tiny_models import PagedCache

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    hkv = layers[0].num_kv_heads
    backend = TritonPagedAttention(PAGE, layers[0].num_heads // hkv, hkv, num_sms=1)
    cache = PagedCache(model, num_blocks=8, block_size=PAGE)
    for layer in layers:
        layer.backend = backend
    model.model._stack = None
    real = tdl.DecoderStack
    built: list[tdl.DecoderStack] = []

    def make(*args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(real(*args, **kwargs, **stack_args))
        return built[-1]

    tdl.DecoderStack = make  # type: ignore[misc]
    fused._interpret = DEVICE.type == "cpu"
    fused.set_layer_kernel(layer_kernel)
    outs = []
    try:
        for start, end in steps:
            md, positions = cache.step([(0, end - start)])
            backend.prepare(md, has_cache=True)
            with forward_context(md), torch.no_grad():
                outs.append(model(ids[start:end], positions)[0].clone())
    finally:
        tdl.DecoderStack = real  # type: ignore[misc]
        fused._interpret = False
        fused.set_layer_kernel(None)
    assert len(built) == (1 if layer_kernel else 0)
    return outs + [t for layer in layers for t in (layer.k_cache, layer.v_cache)]


@kernel_test
@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
@pytest.mark.parametrize("splits, tile_programs", [(1, 1), (2, 3), (4, 5)])
def test_layer_kernel_equals_per_op_kernels(kind: str, splits: int, tile_programs: int
                                            ) -> None:
    """A prompt of 7 (the usual path), then one-row decodes across page boundaries (slices
    empty, partly and wholly filled): hidden states and caches as the per-op kernels give."""
    model = _tiny(kind, seed=3)
    ids = torch.randint(0, 128, (14,), device=DEVICE)
    steps = [(0, 7)] + [(p, p + 1) for p in range(7, 14)]
    args = {} if DEVICE.type == "cuda" else dict(programs=1, splits=splits,
                                                  tile_programs=tile_programs)
    want = _run(model, ids, steps, layer_kernel=False, stack_args={})
    got = _run(model, ids, steps, layer_kernel=True, stack_args=args)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=f"output {i}")


@kernel_test
def test_layer_kernel_not_taken() -> None:
    """Where the path does not apply it is not taken: here, no KV cache bound."""
    from omnistage.layers.attention import AttentionMetadata, forward_context

    model = _tiny("qwen3", seed=4)
    md = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.long, device=DEVICE),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.ones(1, dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
        query_start_loc_cpu=[0, 1], seq_lens_cpu=[1], max_query_len=1, max_seq_len=1)
    fused._interpret = DEVICE.type == "cpu"
    try:
        h = torch.randn(1, 64, device=DEVICE)
        with forward_context(md):
            assert model.model._layer_stack(h, torch.zeros(1, dtype=torch.long,
                                                           device=DEVICE)) is None  # no cache
    finally:
        fused._interpret = False
