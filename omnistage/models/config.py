"""`ModelConfig`: what our model files read, taken from an HF config in one place.

`from_hf` is the only function that reads HF config attributes (with their defaults and the
old/new spellings); model files read typed fields only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, PretrainedConfig

# Facts that an HF config leaves to its modeling file.
# Qwen2, Qwen2.5-Omni's thinker and talker, GLM-Image's text decoder: bias on q/k/v, none on
# o_proj
_QKV_BIAS_ALWAYS = {"qwen2", "qwen2_5_omni_text", "qwen2_5_omni_talker", "glm_image_text"}
_QK_NORM = {"qwen3", "qwen3_moe"}          # RMSNorm over each head of q and k


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False           # bias on the q/k/v projections
    o_proj_bias: bool = False
    has_qk_norm: bool = False
    sliding_window: int | None = None      # set only when some layer uses sliding attention
    torch_dtype: str = "float32"           # the checkpoint's dtype, e.g. "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # HF's rope dict, always with "rope_type" and "rope_theta" (plus "factor", ... if scaled)
    rope_parameters: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", "default")

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig,
                generation_config: GenerationConfig | None = None,
                architecture: str | None = None) -> ModelConfig:
        """`architecture`: the whole checkpoint's, for a sub-config (a multi-part model's
        decoder) that names none; None: config.json's `architectures`."""
        architectures = [architecture] if architecture else \
            getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry: cannot pick a model class")
        model_type = getattr(hf_config, "model_type", "")
        num_heads = hf_config.num_attention_heads
        attention_bias = getattr(hf_config, "attention_bias", False)
        qkv_bias = model_type in _QKV_BIAS_ALWAYS or attention_bias
        layer_types = getattr(hf_config, "layer_types", None) or ()
        rope_parameters = _rope_parameters(hf_config)
        return cls(
            architecture=architectures[0],
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
            rms_norm_eps=getattr(hf_config, "rms_norm_eps", 1e-6),
            rope_theta=float(rope_parameters["rope_theta"]),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=attention_bias and model_type not in _QKV_BIAS_ALWAYS,
            has_qk_norm=model_type in _QK_NORM,
            sliding_window=(getattr(hf_config, "sliding_window", None)
                            if "sliding_attention" in layer_types else None),
            torch_dtype=_dtype_name(getattr(hf_config, "dtype", None)
                                    or getattr(hf_config, "torch_dtype", None)),
            eos_token_ids=_eos_token_ids(hf_config, generation_config),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            rope_parameters=rope_parameters,
        )


def check_tensor_parallel(cfg: ModelConfig, size: int, **split_sizes: int) -> None:
    """Refuse a tensor-parallel `size` that does not split the model evenly: ValueError naming
    every config field that does not divide. Attention heads split over the ranks, and so does
    each of `split_sizes` (the MLPs' intermediate sizes, by field name); key/value heads split
    too, or are replicated when there are fewer than ranks, so their count must divide the
    size then. The vocabulary is padded to a multiple of the size (layers/parallel.py)."""
    if size == 1:
        return
    problems = [f"{name} ({n})" for name, n in
                (("num_attention_heads", cfg.num_attention_heads), *split_sizes.items())
                if n % size]
    kv = cfg.num_key_value_heads
    if (kv % size if kv >= size else size % kv):
        problems.append(f"num_key_value_heads ({kv}; it must divide or be divisible by it)")
    if problems:
        raise ValueError(f"{cfg.architecture}: tensor_parallel_size {size} does not divide "
                         + ", ".join(problems))


def _rope_parameters(hf_config: PretrainedConfig) -> dict[str, Any]:
    """transformers 5: `rope_parameters` = {"rope_type", "rope_theta", ...}; older configs:
    `rope_theta` plus an optional `rope_scaling` dict that says "type" or "rope_type"."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    if any(isinstance(v, dict) for v in params.values()):
        raise NotImplementedError(f"per-layer-type rope_parameters are not supported: {params}")
    params.setdefault("rope_type", params.pop("type", "default"))
    if params["rope_type"] in ("yarn", "llama3", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None)
                          or hf_config.max_position_embeddings)
    return params


def _dtype_name(dtype: torch.dtype | str | None) -> str:
    if dtype is None:
        return "float32"
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"config.json dtype {dtype!r}: not a torch dtype")
    return name


def _eos_token_ids(hf_config: PretrainedConfig,
                   generation_config: GenerationConfig | None) -> tuple[int, ...]:
    """What HF `generate` stops on: the generation config's eos, else the model config's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
