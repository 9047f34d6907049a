"""GPU-only checks (skipped without CUDA) of the fast AR path: the Triton paged-attention kernels
equal the reference attention in bfloat16 on realistic shapes; decode steps replayed from CUDA
graphs equal eager ones (float32: the same tokens and logprobs within 1e-4; bfloat16: the top-k
rule); a model that synchronises in its forward pass falls back to eager; and the whole engine
in bfloat16 (Triton attention, fused ops, graphs) agrees with transformers within the usual
top-k rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage.ar.inputs import StreamInput
from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig
from omnistage.layers.attention import TorchPagedAttention
from omnistage.sampling_params import SamplingParams
from omnistage.testing.attention import mixed_batch_metadata

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [list(range(3, 3 + n)) for n in (1, 17, 64, 150, 5)]


def make_engine(path: Path, dtype: str, enforce_eager: bool, max_num_seqs: int = 8,
                attention_backend: str = "auto") -> AREngine:
    return AREngine(ARConfig(model=str(path), device="cuda", dtype=dtype,
                             enforce_eager=enforce_eager, attention_backend=attention_backend,
                             kv_cache=KVCacheConfig(num_blocks=256),
                             scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                       max_num_batched_tokens=96)))


def run(engine: AREngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, dict]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got: dict[str, dict] = {str(i): {"ids": [], "logprobs": [], "hidden": []}
                            for i in range(len(prompts))}
    while engine.has_unfinished_requests:
        for o in engine.step():
            got[o.request_id]["ids"] += o.new_token_ids
            got[o.request_id]["logprobs"] += o.logprobs or []
            if o.hidden_states:
                got[o.request_id]["hidden"].append(o.hidden_states)
    return got


# -- attention kernels ---------------------------------------------------------------------------

def paged_batch(shapes: list[tuple[int, int]], num_heads: int, num_kv_heads: int,
                head_dim: int, block_size: int, dtype: torch.dtype):
    """Random sequences (cached, new) on scattered pages: q/k/v rows, caches, metadata and
    each sequence's full float64 (k, v)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in shapes) + 8
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda",
                          generator=gen).to(dtype)
    v_cache = torch.randn(k_cache.shape, device="cuda", generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).tolist()
    tables, full, qs, ks, vs, slots = [], [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        table = [perm.pop() for _ in range(-(-total // block_size))]
        idx = torch.tensor([table[p // block_size] * block_size + p % block_size
                            for p in range(total)], device="cuda")
        kv = torch.randn(2, total, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
        k_cache.view(-1, num_kv_heads, head_dim)[idx[:cached]] = kv[0, :cached]
        v_cache.view(-1, num_kv_heads, head_dim)[idx[:cached]] = kv[1, :cached]
        tables.append(table)
        full.append(kv.double())
        qs.append(torch.randn(new, num_heads, head_dim, device="cuda", generator=gen).to(dtype))
        ks.append(kv[0, cached:])
        vs.append(kv[1, cached:])
        slots += idx[cached:].tolist()
    md = mixed_batch_metadata(shapes, tables, slots, "cuda")
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, md, qs, full


def reference(q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of q (n, H, D) over the last n positions of kv (2, S, Hkv, D)."""
    n, ctx = q.shape[0], kv.shape[1]
    rep = q.shape[1] // kv.shape[2]
    k, v = kv[0].repeat_interleave(rep, 1), kv[1].repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(ctx, device=q.device)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 4), (14, 2)])
def test_triton_attention_bf16_matches_reference(num_heads: int, num_kv_heads: int) -> None:
    from omnistage.layers.triton_attention import TritonPagedAttention

    # long decodes, a long fresh prefill, chunks on long cached prefixes
    shapes = [(3000, 1), (0, 700), (1500, 300), (17, 1), (255, 1), (40, 129), (0, 1)]
    q, k, v, k_cache, v_cache, md, qs, full = paged_batch(
        shapes, num_heads, num_kv_heads, 128, 16, torch.bfloat16)
    scale = 128 ** -0.5
    torch_caches = (k_cache.clone(), v_cache.clone())
    backend = TritonPagedAttention(16)
    backend.prepare(md, has_cache=True)
    out = backend.forward(q, k, v, k_cache, v_cache, md, scale)
    assert torch.isfinite(out).all()
    for i, qi in enumerate(qs):
        got = out[md.query_start_loc_cpu[i]:md.query_start_loc_cpu[i + 1]].double()
        ref = reference(qi, full[i], scale)
        assert (got - ref).norm() / ref.norm() < 1e-2, (i, shapes[i])
    md.backend_state = None
    ref_out = TorchPagedAttention(16).forward(q, k, v, *torch_caches, md, scale)
    assert torch.equal(k_cache, torch_caches[0]) and torch.equal(v_cache, torch_caches[1])
    assert (out.float() - ref_out.float()).norm() / ref_out.float().norm() < 1e-2


def test_triton_attention_fp32_is_exact_enough() -> None:
    from omnistage.layers.triton_attention import TritonPagedAttention

    shapes = [(500, 1), (0, 90), (60, 33), (7, 1)]
    q, k, v, k_cache, v_cache, md, qs, full = paged_batch(shapes, 8, 2, 64, 16, torch.float32)
    backend = TritonPagedAttention(16)
    backend.prepare(md, has_cache=True)
    out = backend.forward(q, k, v, k_cache, v_cache, md, 0.125)
    for i, qi in enumerate(qs):
        got = out[md.query_start_loc_cpu[i]:md.query_start_loc_cpu[i + 1]].double()
        torch.testing.assert_close(got, reference(qi, full[i], 0.125), atol=1e-5, rtol=1e-5)


# -- CUDA graphs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_equals_eager(tiny_qwen3: Path, dtype: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=5, ignore_eos=True)
    eager = make_engine(tiny_qwen3, dtype, enforce_eager=True)
    assert eager.runner.graphs is None and eager.runner.prefill_graphs is None
    want = run(eager, PROMPTS, params)
    del eager
    graphed = make_engine(tiny_qwen3, dtype, enforce_eager=False)
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    prefills = graphed.runner.prefill_graphs     # steps of up to 96 tokens (the step budget)
    assert prefills is not None and prefills.sizes == [16, 32, 64, 96]
    got = run(graphed, PROMPTS, params)
    assert graphs.num_replays > 0   # five sequences decode in the bucket of 8 (3 padding rows)
    assert prefills.num_replays > 0  # the prompts' steps (chunks of 96, the rest mixed)
    for rid in want:
        ids, ref_ids = got[rid]["ids"], want[rid]["ids"]
        if dtype == "float32":   # same arithmetic up to float32 rounding: the same tokens
            assert ids == ref_ids, rid
        for j, (a, b) in enumerate(zip(ids, ref_ids)):
            lp, ref_lp = got[rid]["logprobs"][j], want[rid]["logprobs"][j]
            if a != b:
                # bf16: the padded batch (other GEMM shapes, other split-K) rounds otherwise;
                # a flipped near-tie must be in the other side's top 5, and there we stop
                assert a in ref_lp and b in lp, (rid, j, a, b)
                break
            tol = 1e-4 if dtype == "float32" else 5e-2
            assert abs(lp[a] - ref_lp[b]) < tol, (rid, j, lp[a], ref_lp[b])


@pytest.mark.parametrize("early", ["default", "forced"])
def test_one_row_kernels_with_pdl_equal_cublas(tiny_qwen3: Path, early: str) -> None:
    """A single stream (one-row decode steps in CUDA graphs: the matrix-vector kernels,
    launched with programmatic dependent launch on Hopper) against the same engine with both
    off (cuBLAS, plain launches); float32: the same tokens, logprobs within 1e-4. "forced":
    every kernel lets its dependent launch at its start (pdl.set_early_launch) and the
    attention is one kernel, on any GPU (by default only on an H100)."""
    from omnistage.layers import fused, pdl

    params = SamplingParams(temperature=0, max_tokens=32, logprobs=5, ignore_eos=True)
    fused.set_gemv(False)
    pdl.set_enabled(False)
    try:
        want = run(make_engine(tiny_qwen3, "float32", enforce_eager=False), PROMPTS[1:2], params)
    finally:
        fused.set_gemv(True)
        pdl.set_enabled(True)
    if early == "forced":
        pdl.set_early_launch(True)
        fused.set_decode_attention(True)
    try:
        got = run(make_engine(tiny_qwen3, "float32", enforce_eager=False), PROMPTS[1:2],
                  params)
    finally:
        pdl.reset_early_launch()
        fused.set_decode_attention(None)
    assert got["0"]["ids"] == want["0"]["ids"]
    for a, b in zip(got["0"]["logprobs"], want["0"]["logprobs"]):
        assert a.keys() == b.keys()
        for tok in a:
            assert abs(a[tok] - b[tok]) < 1e-4


def _compare_topk(got: dict, want: dict, tol: float) -> None:
    """Same tokens with logprobs within tol until a near-tie flips (each side's token in the
    other's top 5; then stop)."""
    for rid in want:
        for j, (a, b) in enumerate(zip(got[rid]["ids"], want[rid]["ids"])):
            lp, ref_lp = got[rid]["logprobs"][j], want[rid]["logprobs"][j]
            if a != b:
                assert a in ref_lp and b in lp, (rid, j, a, b)
                break
            assert abs(lp[a] - ref_lp[b]) < tol, (rid, j, lp[a], ref_lp[b])


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_layer_kernel_equals_per_op_kernels(tmp_path: Path, arch: str) -> None:
    """A single stream whose decode steps run each layer as one kernel (a persistent grid
    with grid-wide barriers: triton_decoder_layer.py), in CUDA graphs and eagerly, against
    the per-op kernels: float32, the same tokens and logprobs within 1e-4 (contexts of 2 to
    190 tokens: the attention slices empty, partial and full)."""
    from omnistage.layers import fused
    from omnistage.testing.tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "m", arch)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=5, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[3]]
    fused.set_layer_kernel(False)
    try:
        want = {p: run(make_engine(path, "float32", enforce_eager=True), [prompts[p]], params)
                for p in range(2)}
        fused.set_layer_kernel(True)      # on any GPU (by default only where it is faster)
        for eager in (False, True):
            for p in range(2):
                engine = make_engine(path, "float32", enforce_eager=eager)
                got = run(engine, [prompts[p]], params)
                assert engine.runner.model.model._stack[1] is not None    # the path ran
                assert got["0"]["ids"] == want[p]["0"]["ids"], (eager, p)
                _compare_topk(got, want[p], 1e-4)
    finally:
        fused.set_layer_kernel(None)


def test_layer_kernel_bf16_real_shapes(tmp_path: Path) -> None:
    """Qwen3-0.6B's layer shapes (4 of its layers, bfloat16): the one-kernel-a-layer single
    stream against the per-op kernels, the top-k rule (several tiles and K chunks a program,
    16 attention slices per KV head on a 132-multiprocessor GPU)."""
    from omnistage.layers import fused
    from omnistage.testing.tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "m", hidden_size=1024, intermediate_size=3072,
                                 num_hidden_layers=4, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128)
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=5, ignore_eos=True)
    fused.set_layer_kernel(False)
    try:
        want = run(make_engine(path, "bfloat16", enforce_eager=False), PROMPTS[3:4], params)
        fused.set_layer_kernel(True)
        engine = make_engine(path, "bfloat16", enforce_eager=False)
        got = run(engine, PROMPTS[3:4], params)
    finally:
        fused.set_layer_kernel(None)
    assert engine.runner.model.model._stack[1] is not None
    _compare_topk(got, want, 5e-2)


def test_cuda_graph_with_hidden_state_outputs(tiny_qwen3: Path) -> None:
    """Graphs that also return hidden states are captured on first use; the returned rows are
    copies (the next replay must not change them)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                            output_hidden_layers=[1, 2])
    want = run(make_engine(tiny_qwen3, "float32", enforce_eager=True), PROMPTS[:3], params)
    engine = make_engine(tiny_qwen3, "float32", enforce_eager=False)
    got = run(engine, PROMPTS[:3], params)
    assert any(key[1] == (1, 2) for key in engine.runner.graphs.graphs)
    for rid in want:
        assert got[rid]["ids"] == want[rid]["ids"]
        for layer in (1, 2):
            a = torch.cat([h[layer] for h in got[rid]["hidden"]])
            b = torch.cat([h[layer] for h in want[rid]["hidden"]])
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_cuda_graph_decode_fed_embeddings_equals_eager(tiny_qwen3: Path) -> None:
    """Decodes whose inputs get stream embeddings added (how a talker follows a thinker), then
    a stream pad once the stream is closed, replay the embedding-fed graph variant: the same
    tokens and logprobs as eager. Three requests: bucket 4 with a padding row; the requests
    join at different times, so buckets 1, 2 and 4 are captured mid-run."""
    def run_fed(enforce_eager: bool) -> tuple[dict[str, list], AREngine]:
        engine = make_engine(tiny_qwen3, "float32", enforce_eager=enforce_eager)
        hidden = engine.model_config.hidden_size
        gen = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
        got: dict[str, list] = {}
        for i in range(3):
            prompt = [5 + i, 9, 11, 2 + i]
            engine.add_request(f"s{i}", prompt, params,
                               stream=StreamInput(pad=torch.randn(hidden, generator=gen)))
            engine.extend_request(f"s{i}", stream_embeds=torch.randn(8, hidden, generator=gen),
                                  close_stream=True)
            for _ in range(3):                   # the next request joins a few steps later
                for o in engine.step():
                    got.setdefault(o.request_id, []).append((o.new_token_ids, o.logprobs))
        while engine.has_unfinished_requests:
            for o in engine.step():
                got.setdefault(o.request_id, []).append((o.new_token_ids, o.logprobs))
        return got, engine

    want, _ = run_fed(True)
    got, engine = run_fed(False)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.embeds_ok
    assert {key[0] for key in graphs.graphs if key[2]} >= {1, 2, 4}
    assert set(got) == set(want)
    for rid in want:
        assert [ids for ids, _ in got[rid]] == [ids for ids, _ in want[rid]], rid
        for (_, lp), (_, ref) in zip(got[rid], want[rid]):
            for tok, value in (lp[0] if lp else {}).items():
                assert abs(value - ref[0][tok]) < 1e-4, (rid, tok)


def test_model_that_synchronises_decodes_eagerly(tiny_qwen3: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward pass that reads a device value on the host cannot be captured: no graphs."""
    from omnistage.models.qwen2 import Qwen2Model

    real = Qwen2Model.forward

    def syncing(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        hidden, captured = real(self, *args, **kwargs)
        assert hidden.shape[0] == int(torch.tensor(hidden.shape[0], device=hidden.device).item())
        return hidden, captured

    monkeypatch.setattr(Qwen2Model, "forward", syncing)
    engine = make_engine(tiny_qwen3, "float32", enforce_eager=False)
    assert engine.runner.graphs is None
    got = run(engine, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(g["ids"]) == 4 for g in got.values())


# -- bfloat16 golden ------------------------------------------------------------------------------

def test_bf16_engine_matches_transformers_topk(tiny_qwen3: Path) -> None:
    """Greedy bf16 tokens vs transformers bf16, vLLM's check_logprobs_close rule: up to the first
    difference the tokens are equal; at it, each side's token is in the other's top 5."""
    k, n = 5, 24
    engine = make_engine(tiny_qwen3, "bfloat16", enforce_eager=False)
    params = SamplingParams(temperature=0, max_tokens=n, logprobs=k, ignore_eos=True)
    ours = run(engine, PROMPTS, params)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.bfloat16).cuda().eval()
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
        ref_ids = out.sequences[0, len(prompt):].tolist()
        ref_top = [set(step[0].float().topk(k).indices.tolist()) for step in out.logits]
        mine = ours[str(i)]
        for j, (a, b) in enumerate(zip(mine["ids"], ref_ids)):
            if a != b:
                assert a in ref_top[j] and b in mine["logprobs"][j], (i, j, a, b)
                break
