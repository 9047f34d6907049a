"""Golden: our Qwen3 vs transformers' on the same tiny random weights, in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM

from omnistage.layers.attention import AttentionMetadata, forward_context
from omnistage.models.loader import load_model
from omnistage.testing.tiny_models import PagedCache, build_tiny_checkpoint

CPU = torch.device("cpu")


def hf_logits(path: Path, ids: Tensor) -> Tensor:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(ids[None]).logits[0]


def sequences(vocab: int, lens: list[int], seed: int = 0) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def assert_matches_hf(path: Path, seqs: list[Tensor], steps: list[list[tuple[int, int]]]) -> None:
    """Run `steps` (each one forward pass of (seq id, new tokens) rows) through a paged cache
    and compare every row's logits with HF's over the whole sequence, at the same positions."""
    model, _, _ = load_model(path, CPU)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [ref(s[None]).logits[0] for s in seqs]
    cache = PagedCache(model, num_blocks=64, block_size=4)
    done = [0] * len(seqs)
    for step in steps:
        batch = [(i, seqs[i][done[i]:done[i] + n]) for i, n in step]
        hidden, _ = cache.run(model, batch)
        for (i, n), h in zip(step, hidden):
            torch.testing.assert_close(model.compute_logits(h), expected[i][done[i]:done[i] + n],
                                       atol=1e-5, rtol=1e-4, msg=lambda m: f"seq {i}: {m}")
            done[i] += n
    assert done == [len(s) for s in seqs]


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_tied"])
def test_prefill_batch_matches_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    seqs = sequences(400, [7, 13, 3])
    assert_matches_hf(path, seqs, [[(0, 7), (1, 13), (2, 3)]])


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_qwen3_tied"])
def test_chunked_prefill_and_decode_match_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    seqs = sequences(400, [9, 15, 5], seed=1)
    assert_matches_hf(path, seqs, [
        [(0, 7), (1, 6)],              # seq 0 prefill, seq 1 first chunk
        [(0, 1), (1, 7), (2, 4)],      # decode, last chunk, new prefill in one batch
        [(0, 1), (1, 1), (2, 1)],      # decode everyone
        [(1, 1)],
    ])


def test_prefill_without_kv_cache(tiny_qwen3: Path) -> None:
    """A profiling pass runs with no cache bound; prefill must work all the same."""
    model, _, _ = load_model(tiny_qwen3, CPU)
    seqs = sequences(400, [6, 4])
    md = AttentionMetadata(
        slot_mapping=torch.zeros(10, dtype=torch.int64), query_start_loc=torch.tensor([0, 6, 10]),
        seq_lens=torch.tensor([6, 4]), block_tables=torch.zeros((2, 1), dtype=torch.int32),
        query_start_loc_cpu=[0, 6, 10], seq_lens_cpu=[6, 4], max_query_len=6, max_seq_len=6)
    positions = torch.cat([torch.arange(6), torch.arange(4)])
    with torch.no_grad(), forward_context(md):
        hidden, _ = model(torch.cat(seqs), positions)
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits[6:], hf_logits(tiny_qwen3, seqs[1]), atol=1e-5, rtol=1e-4)


def test_capture_layers_match_hf_hidden_states(tiny_qwen3: Path) -> None:
    model, cfg, _ = load_model(tiny_qwen3, CPU)
    seqs = sequences(400, [5, 8])
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    num_layers = cfg.num_hidden_layers
    hidden, captured = PagedCache(model).run(model, [(0, seqs[0]), (1, seqs[1])],
                                             capture_layers=(0, 1, num_layers))
    assert sorted(captured) == [0, 1, num_layers]
    for row, seq in enumerate(seqs):
        with torch.no_grad():
            expected = ref(seq[None], output_hidden_states=True).hidden_states
        assert len(expected) == num_layers + 1
        for layer in (0, 1, num_layers):
            torch.testing.assert_close(captured[layer][row], expected[layer][0],
                                       atol=1e-5, rtol=1e-4, msg=lambda m: f"layer {layer}: {m}")
        torch.testing.assert_close(hidden[row], captured[num_layers][row], atol=0, rtol=0)


def test_inputs_embeds_replace_input_ids(tiny_qwen3: Path) -> None:
    model, cfg, _ = load_model(tiny_qwen3, CPU)
    (ids,) = sequences(400, [6])
    md, positions = PagedCache(model).step([(0, 6)])
    with torch.no_grad(), forward_context(md):
        embeds = model.embed_input_ids(ids)
        assert embeds.shape == (6, cfg.hidden_size)
        hidden, _ = model(torch.zeros_like(ids), positions, inputs_embeds=embeds)
    torch.testing.assert_close(model.compute_logits(hidden), hf_logits(tiny_qwen3, ids),
                               atol=1e-5, rtol=1e-4)


def test_sharded_checkpoint_loads_identically(tiny_qwen3: Path, tmp_path: Path) -> None:
    sharded = build_tiny_checkpoint(tmp_path / "sharded", num_shards=3)
    assert len(list(sharded.glob("model-*.safetensors"))) >= 2
    assert not (sharded / "model.safetensors").exists()
    ours, _, _ = load_model(sharded, CPU)
    single, _, _ = load_model(tiny_qwen3, CPU)
    a, b = ours.state_dict(), single.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
     "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
], ids=["yarn", "linear"])
def test_rope_scaling_matches_hf(rope_parameters: dict, tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "scaled", rope_parameters=rope_parameters)
    _, cfg, _ = load_model(path, CPU)
    assert cfg.rope_type == rope_parameters["rope_type"]
    seqs = sequences(400, [40, 9], seed=2)
    assert_matches_hf(path, seqs, [[(0, 30), (1, 9)], [(0, 10)]])


def test_model_config_from_checkpoint(tiny_qwen3: Path, tiny_qwen3_tied: Path) -> None:
    _, cfg, hf_config = load_model(tiny_qwen3, CPU)
    assert (cfg.architecture, cfg.model_type) == ("Qwen3ForCausalLM", "qwen3")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.has_qk_norm and not cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.torch_dtype == "float32" and cfg.vocab_size == hf_config.vocab_size
    assert cfg.eos_token_ids == (2, 0)   # <|im_end|>, <|endoftext|> from generation_config.json
    assert cfg.rope_type == "default" and cfg.rope_theta == 10000.0
    tied, tied_cfg, _ = load_model(tiny_qwen3_tied, CPU)
    assert tied_cfg.tie_word_embeddings
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_load_in_bfloat16(tiny_qwen3: Path) -> None:
    model, _, _ = load_model(tiny_qwen3, CPU, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    (ids,) = sequences(400, [5])
    hidden, _ = PagedCache(model).run(model, [(0, ids)])
    logits = model.compute_logits(hidden[0])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(tiny_qwen3, ids), atol=0.5, rtol=0.1)
