"""Runs the tensor-parallel layers (layers/parallel.py, and their FP8 forms) on R CPU ranks over gloo against the
same layers' single-rank results, for tests/unit/layers/test_parallel.py (through
omnistage.testing.ranks.run_ranks): every rank loads the whole checkpoint tensors through the
layers' loaders and returns the largest difference of each check."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnistage.layers import parallel as tp
from omnistage.layers.fp8 import Fp8Linear
from omnistage.layers.groups import StageRanks

H, D, HQ, V, INTER = 32, 8, 4, 63, 48   # V odd: the vocabulary padded on 2 ranks


def _weights(num_kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)
    return {"q": w(HQ * D, H), "k": w(num_kv_heads * D, H), "v": w(num_kv_heads * D, H),
            "o": w(H, HQ * D), "gate": w(INTER, H), "up": w(INTER, H), "down": w(H, INTER),
            "down_bias": w(H), "embed": w(V, H), "head": w(V, H), "x": w(5, H),
            "ids": torch.cat([torch.randint(0, V, (7,), generator=g), torch.tensor([V - 1, 0])])}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to the largest |want| (float32 sums in another order)."""
    return float((got - want).abs().max() / want.abs().max())


def _checks(t: dict[str, torch.Tensor], num_kv_heads: int) -> dict[str, float]:
    """Largest relative difference, parallel against whole, per layer on this rank."""
    group = tp.tp_group()
    x = t["x"]
    qkv = tp.QKVParallelLinear(H, D, HQ, num_kv_heads)
    for shard in ("q", "k", "v"):
        qkv.weight_loader(qkv.weight, t[shard], shard)
    q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
    heads = slice(group.rank * qkv.q_size, (group.rank + 1) * qkv.q_size)
    kv = slice(qkv.kv_start * D, qkv.kv_start * D + qkv.kv_size)
    out = {"q": _rel(q, F.linear(x, t["q"])[:, heads]),
           "k": _rel(k, F.linear(x, t["k"])[:, kv]),
           "v": _rel(v, F.linear(x, t["v"])[:, kv])}

    gate_up = tp.MergedColumnParallelLinear(H, [INTER, INTER])
    gate_up.weight_loader(gate_up.weight, t["gate"], 0)
    gate_up.weight_loader(gate_up.weight, t["up"], 1)
    down = tp.RowParallelLinear(INTER, H, bias=True)
    down.weight_loader(down.weight, t["down"])
    down.bias.weight_loader(down.bias, t["down_bias"])
    g, u = gate_up(x).chunk(2, dim=-1)
    whole = F.linear(F.silu(F.linear(x, t["gate"])) * F.linear(x, t["up"]), t["down"],
                     t["down_bias"])
    out["mlp"] = _rel(down(F.silu(g) * u), whole)

    o = tp.RowParallelLinear(HQ * D, H)
    o.weight_loader(o.weight, t["o"])
    attn = F.linear(x, t["q"])                      # stands for the attention output (T, Hq*D)
    out["o_proj"] = _rel(o(attn[:, heads]), F.linear(attn, t["o"]))
    # FP8 (layers/fp8.py) of this rank's shards: the row-parallel sum with its bias once, the
    # gathered column-parallel output; against the whole float layers (FP8's error)
    out["fp8_row"] = _rel(Fp8Linear.from_linear(down)(F.silu(g) * u), whole)
    column = tp.ColumnParallelLinear(H, INTER, bias=True, gather_output=True)
    column.weight_loader(column.weight, t["gate"])
    column.bias.weight_loader(column.bias, t["up"][:, 0])
    out["fp8_column"] = _rel(Fp8Linear.from_linear(column)(x),
                             F.linear(x, t["gate"], t["up"][:, 0]))

    embed = tp.VocabParallelEmbedding(V, H)
    embed.weight_loader(embed.weight, t["embed"])
    out["embed"] = _rel(embed(t["ids"]), F.embedding(t["ids"], t["embed"]))
    head = tp.ParallelLMHead(V, H)
    head.weight_loader(head.weight, t["head"])
    out["lm_head"] = _rel(head(x), F.linear(x, t["head"]))
    return out


def rank_checks(ranks: StageRanks, num_kv_heads: int) -> dict[str, float]:
    """One rank's body (omnistage.testing.ranks.run_ranks; its groups are current)."""
    return _checks(_weights(num_kv_heads), num_kv_heads)
