"""Our cached rotary embedding vs transformers' Qwen3 rotary, for plain and scaled RoPE."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from omnistage.layers.rotary import get_rope

HEAD_DIM, MAX_POS = 16, 512


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
     "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128, "rope_theta": 500000.0},
    {"rope_type": "longrope", "long_factor": [1.0 + i / 4 for i in range(8)],
     "short_factor": [1.0 + i / 16 for i in range(8)], "original_max_position_embeddings": 256,
     "rope_theta": 10000.0},
], ids=lambda p: p["rope_type"])
def test_matches_hf(rope_parameters: dict) -> None:
    hf_config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
                            rope_parameters=dict(rope_parameters))
    ref = Qwen3RotaryEmbedding(hf_config)
    ours = get_rope(HEAD_DIM, MAX_POS, hf_config.rope_parameters)
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 2, 7, 100, 255, 3, 4])   # within the pretraining window
    q = torch.randn(len(positions), 4, HEAD_DIM, generator=g)          # (T, H, D)
    k = torch.randn(len(positions), 2, HEAD_DIM, generator=g)          # (T, Hkv, D)
    cos, sin = ref(q, positions[None])                                 # (1, T, D)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = ours(positions, q, k)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-5)


def test_longrope_uses_long_factors_past_the_window() -> None:
    params = {"rope_type": "longrope", "long_factor": [2.0] * 8, "short_factor": [1.0] * 8,
              "original_max_position_embeddings": 256, "rope_theta": 10000.0}
    rope = get_rope(HEAD_DIM, MAX_POS, params)
    plain = get_rope(HEAD_DIM, MAX_POS, {"rope_type": "default", "rope_theta": 10000.0})
    scale = rope.cos_cache[0, 0]   # cos(0) * attention factor
    torch.testing.assert_close(rope.cos_cache[:256], plain.cos_cache[:256] * scale)
    assert not torch.allclose(rope.cos_cache[256:], plain.cos_cache[256:] * scale)


def test_unsupported_rope_types_are_named() -> None:
    with pytest.raises(NotImplementedError, match="dynamic"):
        get_rope(HEAD_DIM, MAX_POS, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="'made_up'"):
        get_rope(HEAD_DIM, MAX_POS, {"rope_type": "made_up", "rope_theta": 1e4})
