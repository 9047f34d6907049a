"""Golden: the Qwen2.5-Omni thinker's text path vs transformers' on the same tiny random
checkpoint, float32: logits through our paged cache, and greedy tokens through the AR engine
with continuous batching, chunked prefill and prefix caching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, KVCacheConfig, SchedulerConfig
from omnistage.layers.attention import forward_context
from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniThinkerForCausalLM
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_models import PagedCache

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def thinker(omni25_path: Path) -> Qwen2_5OmniThinkerForCausalLM:
    return Qwen2_5OmniThinkerForCausalLM.from_pretrained(omni25_path)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, vocab, (20,), generator=g).tolist()
    return [shared + torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 11, 29)]


def test_logits_match_hf_with_chunks_and_decode(thinker, omni25_hf) -> None:
    ref = omni25_hf.thinker
    seq = torch.tensor(prompts(ref.config.text_config.vocab_size)[2])
    with torch.no_grad():
        expected = ref(input_ids=seq[None]).logits[0]
    assert expected.std() > 0.3, "random logits should spread"
    cache = PagedCache(thinker, block_size=4)
    done = 0
    for n in (17, 20, 11, 1):   # two prefill chunks, then decodes
        md, positions = cache.step([(0, n)])
        with torch.no_grad(), forward_context(md):   # text: t = h = w on the three axes
            hidden, _ = thinker(seq[done:done + n], positions.expand(3, -1))
        torch.testing.assert_close(thinker.compute_logits(hidden), expected[done:done + n],
                                   atol=1e-5, rtol=1e-4)
        done += n
    assert done == seq.shape[0]


def test_engine_greedy_tokens_equal_hf(omni25_path: Path, omni25_hf) -> None:
    def load(path, device, dtype):
        model = Qwen2_5OmniThinkerForCausalLM.from_pretrained(path, device, dtype)
        return model, model.model_config, None

    engine = AREngine(ARConfig(model=str(omni25_path), device="cpu", dtype="float32",
                               kv_cache=KVCacheConfig(block_size=4, enable_prefix_caching=True),
                               scheduler=SchedulerConfig(max_num_batched_tokens=24)),
                      loader=load)
    batch = prompts(omni25_hf.thinker.config.text_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    for _ in range(200):
        if not engine.has_unfinished_requests:
            break
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    for i, p in enumerate(batch):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = omni25_hf.thinker.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                             do_sample=False, max_new_tokens=MAX_TOKENS,
                                             min_new_tokens=MAX_TOKENS)
        assert got[f"r{i}"] == ref[0, len(p):].tolist(), f"prompt {i}"


def test_contiguous_mrope_matches_hf(thinker, omni25_hf) -> None:
    """Three different position rows (an image block): the contiguous sections, not Qwen3's
    interleaved ones, as the reference rotates."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    ref = Qwen2_5OmniRotaryEmbedding(omni25_hf.thinker.config.text_config)
    ours = thinker.model.layers[0].self_attn.rotary_emb
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 500, (3, 9), generator=g)
    q, k = torch.randn(9, 4, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    cos, sin = ref(q, positions[:, None, :])                        # (1, 9, D)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = ours(positions, q, k)
    torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
