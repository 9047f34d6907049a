"""Qwen3-Omni thinker, text part: a Qwen3-style MoE decoder with M-RoPE and DeepStack.

    inputs_embeds (T, hidden)  text embeddings, with audio / image / video features already
                               scattered into their placeholder rows by the caller
    -> L x [ attention (GQA, q/k RMSNorm, interleaved M-RoPE over positions (3, T))
             MoE (router top-k over E experts), or a dense MLP on `mlp_only_layers` ]
       after layer i < num_deepstack: hidden[rows] += deepstack_features[i]
    -> final norm -> lm_head

DeepStack: the vision encoder also returns features of some of its inner layers, one
(K, hidden) tensor per deepstack layer for the K visual tokens; the reference adds feature i to
the visual rows of the output of decoder layer i. Here `deepstack = (rows (K,), features
(num_deepstack, K, hidden))`, rows indexing the flattened batch.

Tensor parallelism: attention and dense MLPs as in qwen2.py, each expert's intermediate size
split (moe.py), the vocabulary split in the embedding and the LM head.

This file also holds what the talker shares with the thinker: the MoE decoder itself, the
`Qwen3OmniTextConfig` read from an HF text sub-config, and strict loading of one component
(a name prefix such as `thinker.`) out of the one Qwen3-Omni checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from omnistage.layers.mrope import MRotaryEmbedding
from omnistage.layers.norm import RMSNorm
from omnistage.layers.parallel import ParallelLMHead, VocabParallelEmbedding, tp_group
from omnistage.models.causal_lm import CausalLM
from omnistage.models.config import ModelConfig, check_tensor_parallel
from omnistage.models.loader import build_and_load, checkpoint_names, load_packed_weights
from omnistage.models.qwen2 import Qwen2Attention, Qwen2MLP
from omnistage.models.qwen3_omni.moe import (MoeConfig, SparseMoeBlock, expand_expert_names,
                                             load_expert_weight)

ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"
# checkpoint name -> (our fused parameter, shard id); read by the weight loader
PACKED_MODULES = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                  "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                  "up_proj": ("gate_up_proj", 1)}
DEFAULT_MROPE_SECTION = (24, 20, 20)   # the reference's default when rope_parameters has none


@dataclass(frozen=True, slots=True)
class Qwen3OmniTextConfig:
    """The thinker's or the talker's text decoder. `model` is what the AR engine reads (sizes
    for the KV cache, eos ids, max length); the rest is what only these models need."""

    model: ModelConfig
    moe: MoeConfig
    mrope_section: tuple[int, int, int]
    moe_layers: tuple[int, ...]            # layers with a sparse MoE block; the rest dense MLP

    @classmethod
    def thinker(cls, hf_config: PretrainedConfig,
                generation_config: GenerationConfig | None = None) -> Qwen3OmniTextConfig:
        """From the whole checkpoint's `Qwen3OmniMoeConfig` (its thinker_config.text_config)."""
        _check_omni(hf_config)
        thinker = hf_config.thinker_config
        text = thinker.text_config
        eos = _token_ids(getattr(generation_config, "eos_token_id", None))
        eos = eos or _token_ids(getattr(text, "eos_token_id", None))
        eos = eos or _token_ids(getattr(hf_config, "im_end_token_id", None))
        sparse_step = text.decoder_sparse_step
        mlp_only = set(text.mlp_only_layers or ())
        moe_layers = tuple(i for i in range(text.num_hidden_layers)
                           if i not in mlp_only and text.num_experts > 0
                           and (i + 1) % sparse_step == 0)
        tie = bool(getattr(thinker, "tie_word_embeddings", False))
        return cls(model=_model_config(hf_config, text, eos, tie),
                   moe=MoeConfig.from_hf(text, has_shared_expert=False),
                   mrope_section=_mrope_section(text), moe_layers=moe_layers)

    @classmethod
    def talker(cls, hf_config: PretrainedConfig) -> Qwen3OmniTextConfig:
        """From the whole checkpoint's config (its talker_config.text_config). Every talker
        layer is sparse with a shared expert: the reference ignores `mlp_only_layers` and
        `decoder_sparse_step` there."""
        _check_omni(hf_config)
        talker = hf_config.talker_config
        text = talker.text_config
        tie = bool(getattr(talker, "tie_word_embeddings", False))
        return cls(model=_model_config(hf_config, text, (talker.codec_eos_token_id,), tie),
                   moe=MoeConfig.from_hf(text, has_shared_expert=True),
                   mrope_section=_mrope_section(text),
                   moe_layers=tuple(range(text.num_hidden_layers)))


def _check_omni(hf_config: PretrainedConfig) -> None:
    if getattr(hf_config, "model_type", None) != "qwen3_omni_moe":
        raise ValueError(f"config.json model_type {getattr(hf_config, 'model_type', None)!r}: "
                         f"expected 'qwen3_omni_moe' ({ARCHITECTURE})")


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _mrope_section(text: PretrainedConfig) -> tuple[int, int, int]:
    section = (text.rope_parameters or {}).get("mrope_section") or DEFAULT_MROPE_SECTION
    if len(section) != 3:
        raise ValueError(f"rope_parameters.mrope_section {section}: expected 3 sections")
    return tuple(int(s) for s in section)  # type: ignore[return-value]


def _model_config(hf_config: PretrainedConfig, text: PretrainedConfig,
                  eos_token_ids: tuple[int, ...], tie_word_embeddings: bool) -> ModelConfig:
    """The engine-facing `ModelConfig` of one text decoder of the checkpoint."""
    rope_parameters = dict(text.rope_parameters or {})
    if "rope_theta" not in rope_parameters:
        raise ValueError(f"{text.model_type}: rope_parameters has no rope_theta")
    rope_parameters.setdefault("rope_type", "default")
    num_heads = text.num_attention_heads
    dtype = getattr(hf_config, "dtype", None) or "float32"
    return ModelConfig(
        architecture=ARCHITECTURE,
        model_type=text.model_type,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=float(rope_parameters["rope_theta"]),
        max_position_embeddings=text.max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=bool(text.attention_bias),   # the reference: q, k, v and o alike
        o_proj_bias=bool(text.attention_bias),
        has_qk_norm=True,
        torch_dtype=str(dtype).removeprefix("torch."),
        eos_token_ids=eos_token_ids,
        rope_parameters=rope_parameters,
    )


# -- the MoE decoder, shared by thinker and talker ---------------------------------------------

class Qwen3OmniMoeDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3OmniTextConfig, rotary_emb: MRotaryEmbedding,
                 is_sparse: bool) -> None:
        super().__init__()
        mc = cfg.model
        # Qwen2Attention only calls rotary_emb(positions, q, k): M-RoPE fits in unchanged.
        self.self_attn = Qwen2Attention(mc, rotary_emb)  # type: ignore[arg-type]
        self.mlp: nn.Module = SparseMoeBlock(mc.hidden_size, cfg.moe) if is_sparse else Qwen2MLP(mc)
        self.input_layernorm = RMSNorm(mc.hidden_size, eps=mc.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, eps=mc.rms_norm_eps)

    def forward(self, positions: Tensor, h: Tensor) -> Tensor:
        h = h + self.self_attn(positions, self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3OmniMoeDecoder(nn.Module):
    """Layers and final norm; subclasses add their input embedding."""

    def __init__(self, cfg: Qwen3OmniTextConfig) -> None:
        super().__init__()
        mc = cfg.model
        _check_tensor_parallel(cfg)
        self.num_layers = mc.num_hidden_layers
        # Qwen3-Omni interleaves the sections whatever rope_parameters["interleaved"] says.
        rotary_emb = MRotaryEmbedding(mc.head_dim, mc.max_position_embeddings,
                                      mc.rope_parameters, cfg.mrope_section, interleaved=True)
        self.layers = nn.ModuleList(
            Qwen3OmniMoeDecoderLayer(cfg, rotary_emb, i in cfg.moe_layers)
            for i in range(mc.num_hidden_layers))
        self.norm = RMSNorm(mc.hidden_size, eps=mc.rms_norm_eps)

    def decode(self, h: Tensor, positions: Tensor, capture_layers: tuple[int, ...] = (),
               deepstack: tuple[Tensor, Tensor] | None = None
               ) -> tuple[Tensor, dict[int, Tensor]]:
        """h: (T, hidden) input embeddings; positions (T,) or (3, T). Hidden states are numbered
        as HF's `output_hidden_states`: 0 = embeddings, i = output of decoder layer i (before
        its deepstack addition, as the reference records it), num_layers = after the norm."""
        assert all(0 <= i <= self.num_layers for i in capture_layers), \
            f"capture_layers {capture_layers} outside [0, {self.num_layers}]"
        rows, features = deepstack if deepstack is not None else (None, None)
        if features is not None:
            assert rows.dim() == 1 and features.dim() == 3 and \
                features.shape[1:] == (rows.shape[0], h.shape[1]) and \
                features.shape[0] <= self.num_layers, \
                f"deepstack rows {tuple(rows.shape)}, features {tuple(features.shape)}: " \
                f"expected (K,) and (<= {self.num_layers}, K, {h.shape[1]})"
        captured: dict[int, Tensor] = {}
        if 0 in capture_layers:
            captured[0] = h
        for i, layer in enumerate(self.layers):
            h = layer(positions, h)
            if i + 1 in capture_layers and i + 1 < self.num_layers:
                captured[i + 1] = h
            if features is not None and i < features.shape[0]:
                # out of place: captured[i + 1] stays the layer's own output, as in HF
                h = h.index_add(0, rows, features[i].to(h.dtype))
        h = self.norm(h)
        if self.num_layers in capture_layers:
            captured[self.num_layers] = h
        return h, captured


def _check_tensor_parallel(cfg: Qwen3OmniTextConfig) -> None:
    """Refuse a tensor-parallel size that does not divide the sizes this decoder splits."""
    mc, sizes = cfg.model, {}
    if cfg.moe_layers:
        sizes["moe_intermediate_size"] = cfg.moe.moe_intermediate_size
    if cfg.moe.shared_expert_intermediate_size:
        sizes["shared_expert_intermediate_size"] = cfg.moe.shared_expert_intermediate_size
    if len(cfg.moe_layers) < mc.num_hidden_layers:      # dense MLP layers
        sizes["intermediate_size"] = mc.intermediate_size
    check_tensor_parallel(mc, tp_group().world_size, **sizes)


class Qwen3OmniThinkerTextModel(Qwen3OmniMoeDecoder):
    def __init__(self, cfg: Qwen3OmniTextConfig) -> None:
        super().__init__(cfg)
        mc = cfg.model
        self.embed_tokens = VocabParallelEmbedding(mc.vocab_size, mc.hidden_size)


class Qwen3OmniThinkerForCausalLM(CausalLM):
    packed_modules = PACKED_MODULES
    # the part of the checkpoint this model loads: thinker.* except the encoders
    checkpoint_prefix = "thinker."
    checkpoint_exclude = ("audio_tower.", "visual.")
    uses_mrope = True               # the runner passes (3, T) positions

    def __init__(self, config: Qwen3OmniTextConfig) -> None:
        super().__init__()
        self.config = config
        mc = config.model
        self.model = Qwen3OmniThinkerTextModel(config)
        self.lm_head = ParallelLMHead(mc.vocab_size, mc.hidden_size)
        if mc.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Qwen3OmniThinkerForCausalLM:
        """Build from config.json (thinker_config.text_config) and load `thinker.model.*` and
        `thinker.lm_head.*` strictly; dtype None: the checkpoint's."""
        path = Path(path)
        hf_config = AutoConfig.from_pretrained(path)
        generation_config = None
        if (path / "generation_config.json").is_file():
            generation_config = GenerationConfig.from_pretrained(path)
        config = Qwen3OmniTextConfig.thinker(hf_config, generation_config)
        return build_and_load(cls, config, config.model, path, device, dtype)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)                   # (T,) -> (T, hidden)

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = (),
                deepstack: tuple[Tensor, Tensor] | None = None
                ) -> tuple[Tensor, dict[int, Tensor]]:
        """input_ids (T,) (ignored where inputs_embeds (T, hidden) is given); positions (T,)
        or (3, T); deepstack = (rows (K,), features (num_deepstack, K, hidden))."""
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model.decode(h, positions, capture_layers, deepstack)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()                         # (N, hidden) -> (N, vocab)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return load_moe_model_weights(self, weights, self.packed_modules)

    def checkpoint_names(self) -> set[str]:
        return expand_expert_names(checkpoint_names(self, self.packed_modules),
                                   self.config.moe.num_experts)


# -- loading one component of the checkpoint ---------------------------------------------------

def load_moe_model_weights(model: nn.Module, weights: Iterable[tuple[str, Tensor]],
                           packed_modules: dict[str, tuple[str, int | str]]) -> set[str]:
    """Per-expert tensors into their fused 3D parameters, everything else through the packed
    loader. Returns the parameter names loaded."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()

    def dense() -> Iterator[tuple[str, Tensor]]:
        for name, tensor in weights:
            param_name = load_expert_weight(params, name, tensor)
            if param_name is None:
                yield name, tensor
            else:
                loaded.add(param_name)

    return loaded | load_packed_weights(model, dense(), packed_modules)
