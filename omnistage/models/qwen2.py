"""Qwen2 (and, with per-head q/k RMSNorm, Qwen3): a pre-norm decoder with GQA attention.

Parameter names match the HF checkpoint except for the fused projections listed in
`packed_modules` (q/k/v -> qkv_proj, gate/up -> gate_up_proj).

Tensor parallelism (the stage's group, layers/parallel.py): each rank holds its attention
heads (and the key/value heads they read), its slice of the MLP's intermediate size and of the
vocabulary; o_proj and down_proj all-reduce, the LM head gathers the whole logits. One rank:
the single-device model.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from omnistage.layers import fused
from omnistage.layers.activation import SiluAndMul
from omnistage.layers.attention import Attention, get_forward_context
from omnistage.layers.norm import RMSNorm
from omnistage.layers.parallel import (MergedColumnParallelLinear, ParallelLMHead,
                                       QKVParallelLinear, RowParallelLinear,
                                       VocabParallelEmbedding, tp_group)
from omnistage.layers.rotary import RotaryEmbedding, get_rope
from omnistage.models.causal_lm import CausalLM
from omnistage.models.config import ModelConfig, check_tensor_parallel
from omnistage.models.loader import load_packed_weights


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim,
                                          cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.num_heads = self.qkv_proj.num_heads            # this rank's (all on one rank)
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.qkv_sizes = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        bias=cfg.o_proj_bias)
        self.has_qk_norm = cfg.has_qk_norm
        if self.has_qk_norm:   # Qwen3: normalise each head before rotary
            self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.rotary_emb = rotary_emb   # one table shared by all layers
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        return self.attend(positions, self.qkv_proj(x))            # x: (T, hidden)

    def attend(self, positions: Tensor, qkv: Tensor) -> Tensor:
        """The rest after the q/k/v projection: qkv (T, (H + 2 Hkv) D) -> (T, hidden)."""
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)              # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)           # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # Qwen3's per-head q/k norm, rotary and the K/V cache store: one fused kernel on CUDA
        out = self.attn.rotate_and_attend(self.rotary_emb, positions, q, k, v,
                                          self.q_norm if self.has_qk_norm else None,
                                          self.k_norm if self.has_qk_norm else None)
        return fused.linear(self.o_proj, out.flatten(1))           # (T, hidden)


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size,
                                                       [cfg.intermediate_size] * 2)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: Tensor) -> Tensor:
        """(T, 2I) -> silu(gate) * up (T, I) -> (T, hidden) (I: this rank's slice)."""
        return fused.silu_linear(self.act_fn, self.down_proj, gate_up)


class Qwen2DecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = Qwen2Attention   # a subclass may attend otherwise

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, rotary_emb)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, positions: Tensor, h: Tensor, residual: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """The layer's input is h + residual (just h for the first layer); returns (mlp out,
        residual) whose sum is its output, so that the next layer's norm does the add (one
        fused kernel on CUDA instead of an add and a norm)."""
        # each norm and the matmul after it: one kernel in a one-row decode step on CUDA
        # (fused.set_gemv), else the norm (with the add) and cuBLAS
        qkv, residual = fused.norm_linear(self.input_layernorm, self.self_attn.qkv_proj, h,
                                          residual)
        attn = self.self_attn.attend(positions, qkv)
        gate_up, residual = fused.norm_linear(self.post_attention_layernorm,
                                              self.mlp.gate_up_proj, attn, residual)
        return self.mlp.down(gate_up), residual


class Qwen2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: nn.Module | None = None) -> None:
        """`rotary_emb`: a position scheme other than the config's plain RoPE, e.g. M-RoPE
        (Qwen2.5-Omni); it is called as rotary_emb(positions, q, k)."""
        super().__init__()
        if cfg.sliding_window is not None:
            raise NotImplementedError(f"{cfg.architecture}: sliding-window attention layers "
                                      "(use_sliding_window) are not supported")
        self.num_layers = cfg.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        if rotary_emb is None:
            rotary_emb = get_rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_parameters)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, rotary_emb)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        # one-row decode steps: every layer one kernel (triton_decoder_layer.py), built at the
        # first such step for the KV cache then bound; (cache address, dtype) -> stack or None
        self._stack: tuple[tuple[int, torch.dtype], object | None] | None = None

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        """Hidden states are numbered as HF's `output_hidden_states`: 0 = embeddings,
        i = output of decoder layer i, num_layers = after the final norm."""
        assert all(0 <= i <= self.num_layers for i in capture_layers), \
            f"capture_layers {capture_layers} outside [0, {self.num_layers}]"
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (T, hidden)
        captured: dict[int, Tensor] = {}
        if 0 in capture_layers:
            captured[0] = h
        residual = None
        stack = (self._layer_stack(h, positions)
                 if set(capture_layers) <= {0, self.num_layers} else None)
        if stack is not None:
            md = get_forward_context()
            h, residual = stack(h.contiguous(), positions, md.slot_mapping, md.seq_lens,
                                md.block_tables)
        else:
            for i, layer in enumerate(self.layers, start=1):
                h, residual = layer(positions, h, residual)
                if i in capture_layers and i < self.num_layers:
                    captured[i] = h + residual                              # the layer's output
        h, _ = self.norm.add_forward(h, residual)
        if self.num_layers in capture_layers:
            captured[self.num_layers] = h
        return h, captured


    def _layer_stack(self, h: Tensor, positions: Tensor):  # -> DecoderStack | None
        """The one-kernel-a-layer path for this step, or None: it takes one row (a single
        stream's decode step) on CUDA with the fused kernels on, a bound KV cache, plain
        rotary, and layers of exactly this module's classes in one dtype, on one rank (its
        kernel has no all-reduce between attention and MLP)."""
        if (h.shape[0] != 1 or positions.dim() != 1
                or self.layers[0].self_attn.o_proj.tp.world_size > 1):
            return None
        md = get_forward_context()
        if md is None or md.num_seqs != 1 or md.max_query_len != 1:
            return None
        tdl = fused.layer_kernel_for(h)
        attn = self.layers[0].self_attn
        cache = getattr(getattr(attn, "attn", None), "k_cache", None)
        if tdl is None or cache is None:
            return None
        key = (cache.data_ptr(), h.dtype)
        if self._stack is None or self._stack[0] != key:
            self._stack = (key, self._build_stack(tdl, h.dtype))
        return self._stack[1]

    def _build_stack(self, tdl, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        layers = []
        first = self.layers[0]
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            if (type(layer) is not Qwen2DecoderLayer or type(a) is not Qwen2Attention
                    or type(mlp) is not Qwen2MLP or a.attn.k_cache is None
                    or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None
                    or layer.input_layernorm.eps != first.input_layernorm.eps
                    or layer.post_attention_layernorm.eps != first.input_layernorm.eps
                    or a.attn.scale != first.self_attn.attn.scale or a.head_dim % 2):
                return None
            if a.has_qk_norm and a.q_norm.eps != a.k_norm.eps:
                return None
            lw = tdl.LayerWeights(
                layer.input_layernorm.weight, a.qkv_proj.weight, a.qkv_proj.bias,
                a.q_norm.weight if a.has_qk_norm else None,
                a.k_norm.weight if a.has_qk_norm else None, a.o_proj.weight, a.o_proj.bias,
                layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
                mlp.down_proj.weight, a.attn.k_cache, a.attn.v_cache)
            if any(t is not None and (t.dtype != dtype or not t.is_contiguous())
                   for t in (lw.input_norm, lw.qkv, lw.qkv_bias, lw.q_norm, lw.k_norm, lw.o,
                             lw.o_bias, lw.post_norm, lw.gate_up, lw.down, lw.k_cache,
                             lw.v_cache)):
                return None
            layers.append(lw)
        a = first.self_attn
        rope = a.rotary_emb
        if type(rope) is not RotaryEmbedding:       # M-RoPE and other position schemes
            return None
        return tdl.DecoderStack(layers, a.num_heads, a.num_kv_heads, a.head_dim,
                                first.input_layernorm.eps,
                                a.q_norm.eps if a.has_qk_norm else 1e-6, a.attn.scale,
                                rope.cos_cache, rope.sin_cache)


class Qwen2ForCausalLM(CausalLM):
    # checkpoint name -> (our fused parameter, shard id); read by the weight loader
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                      "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, rotary_emb: nn.Module | None = None) -> None:
        super().__init__()
        check_tensor_parallel(config, tp_group().world_size,
                              intermediate_size=config.intermediate_size)
        self.config = config
        self.model = Qwen2Model(config, rotary_emb)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)                   # (T,) -> (T, hidden)

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        return self.model(input_ids, positions, inputs_embeds, capture_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return fused.lm_head(self.lm_head, hidden).float()         # (N, hidden) -> (N, vocab)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return load_packed_weights(self, weights, self.packed_modules)
