"""Tensor parallelism of AR stages (issue 18) on 2 CPU ranks over gloo: the engine split over
two processes (omnistage/testing/ar_ranks.py) produces what one rank and transformers
produce, with key/value heads split and replicated, requests of different lengths arriving at
different steps (chunked prefill, prefix hits, batches mixing prefill chunks and decodes),
decode steps replayed from (emulated) CUDA graphs with async scheduling, and Qwen3-Omni's
thinker and talker with everything a step can carry besides token ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage.configs.schema import ParallelSizes
from omnistage.layers import graph_capture
from omnistage.layers.groups import StageRanks
from omnistage.testing.ar_ranks import serve_llm, serve_omni
from omnistage.testing.ranks import run_ranks
from omnistage.testing.tiny_models import build_tiny_checkpoint
from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

TP2 = ParallelSizes(tp=2)
VOCAB = 412         # the tiny tokenizer's 411 ids, padded to split over 2 ranks
# (arrives before step, id, prompt, max tokens): chunks of 16 tokens a step, "e" shares a's
# first 16 tokens (a prefix hit), later arrivals join batches already decoding
WAVES = [(0, "a", list(range(10, 33)), 10), (0, "b", [5, 6, 7, 8, 9], 12),
         (3, "c", list(range(50, 90)), 8), (6, "d", [3], 6),
         (6, "e", list(range(10, 26)) + [1, 2], 9)]
# rank 0 measures the smaller KV budget: both ranks must keep its number of blocks
KV_BYTES = [200_000, 300_000]


def transformers_greedy(path: Path) -> dict[str, list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    for _, rid, prompt, max_tokens in WAVES:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, pad_token_id=0)
        out[rid] = gen[0, len(prompt):].tolist()
    return out


@pytest.mark.parametrize("architecture,num_kv_heads,graphs", [
    ("Qwen3ForCausalLM", 2, False),     # each rank one kv head of two
    ("Qwen3ForCausalLM", 1, False),     # one kv head, replicated on both ranks
    ("Qwen3ForCausalLM", 2, True),      # decode graphs (emulated) and async scheduling
    ("Qwen2ForCausalLM", 2, False),     # q/k/v biases
], ids=["qwen3-kv-split", "qwen3-kv-replicated", "qwen3-graphs", "qwen2-bias"])
def test_two_ranks_equal_one_rank_and_transformers(architecture: str, num_kv_heads: int,
                                                   graphs: bool, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = build_tiny_checkpoint(tmp_path / "ckpt", architecture, vocab_size=VOCAB,
                                 num_key_value_heads=num_kv_heads)
    ranks = run_ranks("omnistage.testing.ar_ranks:serve_llm", TP2,
                      dict(path=str(path), waves=WAVES, kv_bytes=KV_BYTES, graphs=graphs),
                      tmp_path / "ranks")
    monkeypatch.setattr(graph_capture, "capture_graph", graph_capture.capture_graph)
    one = serve_llm(StageRanks.single(), str(path), WAVES, [KV_BYTES[0]])
    want = transformers_greedy(path)
    assert one["tokens"] == want
    assert ranks[0]["tokens"] == want
    # each rank caches one kv head; the stage keeps rank 0's (smaller) number of blocks
    assert [(r["num_kv_heads"], r["num_blocks"]) for r in ranks] == [(1, 195)] * 2
    follower = ranks[1]
    assert follower["plans"]["ForwardPlan"] >= 5
    if graphs:
        assert follower["num_replays"] == ranks[0]["num_replays"] > 0
        assert follower["plans"]["ahead"] > 0 and follower["plans"]["DecodePlan"] > 0


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("omni"), with_processor=False,
                                 thinker_text_overrides={"vocab_size": 432})


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_qwen3_omni_thinker_and_talker_on_two_ranks(omni: Path, graphs: bool, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Thinker: a prompt embedded on arrival (the other rank joins), then given as
    embeddings with multimodal positions and deepstack features, hidden states out. Talker:
    prompt embeddings, stream rows and their pad added, the code predictor's embeddings fed
    back (rank 0 alone runs it). Each equals one rank."""
    ranks = run_ranks("omnistage.testing.ar_ranks:serve_omni", TP2,
                      dict(path=str(omni), graphs=graphs), tmp_path / "ranks")
    monkeypatch.setattr(graph_capture, "capture_graph", graph_capture.capture_graph)
    one = serve_omni(StageRanks.single(), str(omni), graphs=graphs)
    thinker, want = ranks[0]["thinker"], one["thinker"]
    assert thinker["tokens"] == want["tokens"]
    torch.testing.assert_close(torch.tensor(thinker["embed"]), torch.tensor(want["embed"]))
    assert set(thinker["hidden"]) == {"0", "2", "3"}
    for layer, rows in want["hidden"].items():
        got = torch.tensor(thinker["hidden"][layer])
        assert got.shape == (12 + 5, 64)          # every prompt position and 5 decodes
        torch.testing.assert_close(got, torch.tensor(rows), atol=1e-5, rtol=1e-5)
    talker, want = ranks[0]["talker"], one["talker"]
    assert talker["tokens"] == want["tokens"] and talker["codes"] == want["codes"]
    assert all(len(c) == 5 for c in talker["codes"].values())
    plans = ranks[1]["thinker"]["plans"]
    assert plans["EmbedPlan"] == 1
    if graphs:
        assert ranks[1]["talker"]["num_replays"] == ranks[0]["talker"]["num_replays"] > 0


# -- what one process can check --------------------------------------------------------------
