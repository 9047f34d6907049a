"""The sparse mixture-of-experts block of Qwen3-Omni's thinker and talker.

    router:  p = softmax(x W_gate^T) in float32 -> top-k experts per token
             (-> renormalised to sum 1 if norm_topk_prob)
    experts: y = sum_k  p_k * down_e(silu(gate_e(x)) * up_e(x))     e = k-th chosen expert
    talker:  y += sigmoid(x w_shared_gate) * shared_expert(x)         a dense SwiGLU MLP

The experts live in two 3D parameters, `experts.gate_up_proj` (E, 2I, H) with rows | gate | up |
and `experts.down_proj` (E, H, I), as transformers 5 holds them. Checkpoints (the Hub's and what
transformers' `save_pretrained` writes) store one 2D tensor per expert and projection,
`experts.{e}.gate_proj.weight`; `load_expert_weight` copies each into its slice.

The expert compute runs over the flattened batch without per-token loops: the T*k
(token, expert) pairs are sorted by expert, each active expert runs one matmul pair on its
contiguous slice, and the weighted results are added back to their tokens with one index_add.
(The per-expert counts come to the host once per layer to size the slices; a fused-MoE GPU
kernel would replace `FusedExperts.forward` without changing the weights' layout.)

Tensor parallelism splits every expert, not the set of experts: rank r keeps rows
r*I/R .. (r+1)*I/R of each expert's gate and up projections and those columns of its down
projection, so every rank routes every token alike and runs the same grouped GEMMs on
I/R-wide experts; the block all-reduces once, its experts' and shared expert's partial sums
together. (Expert parallelism would need the routed pairs split by owner, and a decode
step's few active experts would load some ranks and idle others; this keeps the kernels and
balances every step's weight reads over the ranks.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from omnistage.layers.activation import SiluAndMul
from omnistage.layers.linear import Linear, copy_checked
from omnistage.layers.parallel import (MergedColumnParallelLinear, RowParallelLinear,
                                       all_reduce, divide, tp_group)

# experts.{e}.{gate,up,down}_proj.weight, as checkpoints store them
_EXPERT_TENSOR = re.compile(r"(?P<base>.+\.experts)\.(?P<idx>\d+)\."
                            r"(?P<proj>gate_proj|up_proj|down_proj)\.weight")
# our fused parameters, as `loader.checkpoint_names` spells them after un-packing gate_up_proj
_FUSED_NAME = re.compile(r"(?P<base>.+\.experts)\.(?P<proj>gate_proj|up_proj|down_proj)")


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int = 0   # 0: no shared expert (the thinker)

    @classmethod
    def from_hf(cls, text_config: PretrainedConfig, has_shared_expert: bool) -> MoeConfig:
        hidden_act = getattr(text_config, "hidden_act", "silu")
        if hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {hidden_act!r}: only silu is supported")
        cfg = cls(
            num_experts=text_config.num_experts,
            num_experts_per_tok=text_config.num_experts_per_tok,
            moe_intermediate_size=text_config.moe_intermediate_size,
            norm_topk_prob=bool(text_config.norm_topk_prob),
            shared_expert_intermediate_size=(text_config.shared_expert_intermediate_size
                                             if has_shared_expert else 0),
        )
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok {cfg.num_experts_per_tok} must be in "
                             f"[1, num_experts={cfg.num_experts}]")
        return cfg


class FusedExperts(nn.Module):
    """E SwiGLU experts in two 3D weights; runs the (token, expert) pairs routed to them. On
    R ranks each holds an I/R-wide slice of every expert and returns its partial sum."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp = tp_group()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.local_size = divide(intermediate_size, self.tp.world_size,
                                 "moe_intermediate_size")
        local = self.local_size
        self.gate_up_proj = nn.Parameter(                                  # rows | gate | up |
            torch.empty(num_experts, 2 * local, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, local), requires_grad=False)
        self.gate_up_proj.weight_loader = self.weight_loader
        self.down_proj.weight_loader = self.weight_loader
        self.act_fn = SiluAndMul()

    def weight_loader(self, param: nn.Parameter, loaded_weight: Tensor,
                      shard_id: tuple[int, int | None] | None = None) -> None:
        """shard_id None: the whole 3D tensor; (e, None): expert e of down_proj;
        (e, 0 | 1): the gate / up rows of expert e of gate_up_proj. Each keeps this rank's
        slice of the intermediate dimension."""
        is_down = param is self.down_proj
        if shard_id is None:
            if tuple(loaded_weight.shape) != (self.num_experts, *self._whole(is_down, None)):
                raise ValueError(f"expected shape {(self.num_experts, *self._whole(is_down, None))}"
                                 f", got {tuple(loaded_weight.shape)}")
            for e in range(self.num_experts):
                for half in ((None,) if is_down else (0, 1)):
                    part = loaded_weight[e]
                    if half is not None:
                        part = part.narrow(0, half * self.intermediate_size,
                                           self.intermediate_size)
                    self.weight_loader(param, part, (e, half))
            return
        expert, half = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (num_experts={self.num_experts})")
        whole = self._whole(is_down, half)
        if tuple(loaded_weight.shape) != whole:
            raise ValueError(f"expected shape {whole}, got {tuple(loaded_weight.shape)}")
        local, start = self.local_size, self.tp.rank * self.local_size
        dst = param.data[expert]
        if is_down:                                   # (H, I): this rank's columns
            copy_checked(dst, loaded_weight.narrow(1, start, local))
        else:                                         # (I, H): this rank's rows of gate / up
            copy_checked(dst.narrow(0, half * local, local), loaded_weight.narrow(0, start, local))

    def _whole(self, is_down: bool, half: int | None) -> tuple[int, int]:
        """The shape of one expert's checkpoint tensor (down, gate or up; half None: the whole
        gate_up rows)."""
        hidden, inter = self.down_proj.shape[1], self.intermediate_size
        if is_down:
            return hidden, inter
        return (inter if half is not None else 2 * inter), hidden

    def forward(self, x: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        """x: (T, H); topk_ids, topk_weights: (T, k) -> (T, H)."""
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()                                       # (T*k,)
        order = flat_ids.argsort(stable=True)                               # pairs by expert
        token_idx = order // top_k                                          # (T*k,)
        xs = x[token_idx]                                                   # (T*k, H)
        if _use_grouped_mm(x):
            out = self._grouped(xs, flat_ids)
        else:
            out = self._looped(xs, flat_ids)
        out = out * topk_weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token_idx, out)

    def _looped(self, xs: Tensor, flat_ids: Tensor) -> Tensor:
        """One matmul pair per expert that has tokens (the counts come to the host)."""
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.empty_like(xs)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            h = self.act_fn(F.linear(xs[start:start + n], self.gate_up_proj[expert]))  # (n, I)
            out[start:start + n] = F.linear(h, self.down_proj[expert])              # (n, H)
            start += n
        return out

    def _grouped(self, xs: Tensor, flat_ids: Tensor) -> Tensor:
        """Both projections as grouped GEMMs over the expert-sorted pairs, with the group ends
        computed on the device: nothing comes to the host, so the step can be a CUDA graph."""
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=xs.device)
        counts.index_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)                          # group ends
        h = torch._grouped_mm(xs, self.gate_up_proj.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(self.act_fn(h), self.down_proj.transpose(-2, -1), offs=offs)


def _use_grouped_mm(x: Tensor) -> bool:
    """Grouped GEMMs where torch has them (bf16 on Hopper-class CUDA devices)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ the talker's gated shared expert). Parameter names follow HF:
    gate.weight, experts.{gate_up_proj,down_proj}, shared_expert.*, shared_expert_gate.weight.
    The router and the shared expert's gate are whole on every rank (every rank routes alike);
    the experts and the shared expert split their intermediate size."""

    def __init__(self, hidden_size: int, cfg: MoeConfig) -> None:
        super().__init__()
        self.tp = tp_group()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Linear(hidden_size, cfg.num_experts)                   # the router
        self.experts = FusedExperts(cfg.num_experts, hidden_size, cfg.moe_intermediate_size)
        self.has_shared_expert = cfg.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = SharedExpert(hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: (T, H) -> expert ids (T, k) and their weights (T, k) in x's dtype."""
        router_logits = self.gate(x)                                        # (T, E)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_ids, topk_weights.to(router_logits.dtype)

    def forward(self, x: Tensor) -> Tensor:                                 # (T, H) -> (T, H)
        topk_ids, topk_weights = self.route(x)
        y = self.experts(x, topk_ids, topk_weights)                        # this rank's part
        if self.has_shared_expert:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(y, self.tp)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP whose output is this rank's partial sum: the block reduces it."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_results=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def load_expert_weight(params: dict[str, nn.Parameter], name: str, tensor: Tensor) -> str | None:
    """If `name` is a per-expert checkpoint tensor (`...experts.{e}.gate_proj.weight`), copy it
    into its slice of the fused parameter and return that parameter's name; else None."""
    m = _EXPERT_TENSOR.fullmatch(name)
    if m is None:
        return None
    proj = m["proj"]
    param_name = f"{m['base']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    param = params.get(param_name)
    if param is None:
        return None
    half = {"gate_proj": 0, "up_proj": 1, "down_proj": None}[proj]
    try:
        param.weight_loader(param, tensor, (int(m["idx"]), half))
    except ValueError as e:
        raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
    return param_name


def expand_expert_names(names: set[str], num_experts: int) -> set[str]:
    """Checkpoint names with every fused expert name (`...experts.gate_proj`, as
    `loader.checkpoint_names` un-packs our `experts.gate_up_proj`) replaced by the per-expert
    tensors a checkpoint stores."""
    out: set[str] = set()
    for name in names:
        m = _FUSED_NAME.fullmatch(name)
        if m is None:
            out.add(name)
        else:
            out.update(f"{m['base']}.{e}.{m['proj']}.weight" for e in range(num_experts))
    return out
