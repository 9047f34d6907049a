"""Tensor parallelism of AR stages (issue 18) on 2 CPU ranks over gloo: the engine split over
two processes (omnistage/testing/ar_ranks.py) produces what one rank and transformers
produce, with key/value heads split and replicated, requests of different lengths arriving at
different steps (chunked prefill, prefix hits, batches mixing prefill chunks and decodes),
decode steps replayed from (emulated) CUDA graphs with async scheduling, and Qwen3-Omni's
thinker and talker with everything a step can carry besides token ids."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig, ParallelSizes
from omnistage.layers.groups import StageRanks, set_stage_ranks
from omnistage.layers.parallel import TPGroup, set_tp_group
from omnistage.models.loader import load_model
from omnistage.models.qwen3_omni.moe import FusedExperts
from omnistage.models.qwen3_omni.thinker import Qwen3OmniMoeDecoder, Qwen3OmniTextConfig
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


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("omni"), with_processor=False,
                                 thinker_text_overrides={"vocab_size": 432})


# -- what one process can check --------------------------------------------------------------

def _as_rank(rank: int) -> None:
    """Build layers as rank `rank` of 2 (loading needs no communication)."""
    set_tp_group(TPGroup(rank, 2, None))


def test_layouts_that_do_not_divide_are_refused(tiny_qwen3: Path, omni: Path) -> None:
    from omnistage.models.qwen3 import Qwen3ForCausalLM

    _, cfg, _ = load_model(tiny_qwen3, torch.device("cpu"))
    cfg = dataclasses.replace(cfg, num_key_value_heads=3, intermediate_size=127)
    try:
        _as_rank(0)
        # (the vocabulary, 411, is padded: not refused)
        with pytest.raises(ValueError, match=r"Qwen3ForCausalLM: tensor_parallel_size 2 does "
                           r"not divide intermediate_size \(127\), "
                           r"num_key_value_heads \(3; "):
            Qwen3ForCausalLM(cfg)
        from transformers import AutoConfig
        text = Qwen3OmniTextConfig.talker(AutoConfig.from_pretrained(omni))
        text = dataclasses.replace(text, moe=dataclasses.replace(text.moe,
                                                                 moe_intermediate_size=25))
        with pytest.raises(ValueError, match=r"does not divide moe_intermediate_size \(25\)$"):
            Qwen3OmniMoeDecoder(text)
    finally:
        set_tp_group(None)


def test_ar_stage_splits_by_tensor_parallelism_only(tiny_qwen3: Path) -> None:
    set_stage_ranks(dataclasses.replace(StageRanks.single(), sizes=ParallelSizes(ulysses=2)))
    try:
        with pytest.raises(ValueError, match="tensor parallelism only"):
            AREngine(ARConfig(model=str(tiny_qwen3), device="cpu"))
    finally:
        set_stage_ranks(None)


def test_experts_keep_their_rank_slice_of_whole_or_per_expert_tensors() -> None:
    """Each expert's gate / up rows and down columns, from per-expert tensors or one 3D
    tensor per projection, as the two ranks' halves of the intermediate dimension."""
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(3, 8, 5, generator=g), torch.randn(3, 8, 5, generator=g)
    down = torch.randn(3, 5, 8, generator=g)
    try:
        for rank in (0, 1):
            _as_rank(rank)
            half = slice(4 * rank, 4 * rank + 4)
            want_gate_up = torch.cat([gate[:, half], up[:, half]], dim=1)
            per_expert, fused = FusedExperts(3, 5, 8), FusedExperts(3, 5, 8)
            for e in range(3):
                per_expert.weight_loader(per_expert.gate_up_proj, gate[e], (e, 0))
                per_expert.weight_loader(per_expert.gate_up_proj, up[e], (e, 1))
                per_expert.weight_loader(per_expert.down_proj, down[e], (e, None))
            fused.weight_loader(fused.gate_up_proj, torch.cat([gate, up], dim=1))
            fused.weight_loader(fused.down_proj, down)
            for m in (per_expert, fused):
                assert torch.equal(m.gate_up_proj, want_gate_up)
                assert torch.equal(m.down_proj, down[:, :, half])
            with pytest.raises(ValueError, match=r"expected shape \(8, 5\), got \(6, 5\)"):
                fused.weight_loader(fused.gate_up_proj, gate[0, :6], (0, 0))
    finally:
        set_tp_group(None)
