"""Golden: our Qwen2 (bias on q/k/v, no q/k norm) vs transformers' on tiny random weights."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from omnistage.models.config import ModelConfig
from omnistage.models.loader import load_model
from omnistage.testing.tiny_models import PagedCache

CPU = torch.device("cpu")


def test_batched_prefill_chunks_and_decode_match_hf(tiny_qwen2: Path) -> None:
    model, _, _ = load_model(tiny_qwen2, CPU)
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 400, (n,), generator=g) for n in (8, 13, 3)]
    with torch.no_grad():
        expected = [ref(s[None]).logits[0] for s in seqs]
    cache = PagedCache(model, block_size=4)
    done = [0, 0, 0]
    steps = [[(0, 7), (1, 5), (2, 2)],   # prefill, first chunk, first chunk
             [(0, 1), (1, 8), (2, 1)]]   # decode, last chunk, decode
    for step in steps:
        hidden, _ = cache.run(model, [(i, seqs[i][done[i]:done[i] + n]) for i, n in step])
        for (i, n), h in zip(step, hidden):
            torch.testing.assert_close(model.compute_logits(h), expected[i][done[i]:done[i] + n],
                                       atol=1e-5, rtol=1e-4, msg=lambda m: f"seq {i}: {m}")
            done[i] += n
    assert done == [8, 13, 3]


def test_qkv_bias_loaded_and_no_qk_norm(tiny_qwen2: Path) -> None:
    model, cfg, _ = load_model(tiny_qwen2, CPU)
    assert cfg.attention_bias and not cfg.o_proj_bias and not cfg.has_qk_norm
    assert cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads   # Qwen2 states no head_dim
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    attn, ref_attn = model.model.layers[1].self_attn, ref.model.layers[1].self_attn
    expected = torch.cat([ref_attn.q_proj.bias, ref_attn.k_proj.bias, ref_attn.v_proj.bias])
    assert torch.equal(attn.qkv_proj.bias, expected) and expected.abs().sum() > 0
    assert attn.o_proj.bias is None and not hasattr(attn, "q_norm")


def test_legacy_rope_fields() -> None:
    """Configs from before transformers 5 carry rope_theta and rope_scaling ("type")."""
    legacy = SimpleNamespace(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=100, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6, torch_dtype="bfloat16",
        rope_scaling={"type": "yarn", "factor": 4.0}, eos_token_id=[7, 8], bos_token_id=1)
    cfg = ModelConfig.from_hf(legacy)
    assert cfg.rope_parameters == {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                   "original_max_position_embeddings": 512}
    assert cfg.rope_theta == 1e6 and cfg.head_dim == 16
    assert cfg.torch_dtype == "bfloat16" and cfg.eos_token_ids == (7, 8) and cfg.bos_token_id == 1
    plain = ModelConfig.from_hf(SimpleNamespace(**{**vars(legacy), "rope_scaling": None}))
    assert plain.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
