"""Qwen2.5-Omni thinker, text part: Qwen2's decoder (qwen2.py) with contiguous M-RoPE.

    inputs_embeds (T, hidden)  text embeddings, with audio / image / video features already
                               scattered into their placeholder rows by the caller
    -> L x [ attention (GQA, bias on q/k/v, M-RoPE over positions (3, T): the first s_t
             frequencies follow t, the next s_h follow h, the last s_w follow w)
             dense SwiGLU MLP ]
    -> final norm -> lm_head

Everything but the rotary embedding is Qwen2ForCausalLM's, so tensor parallelism, the fused
kernels and the weight loading are its too. The talker (talker.py) is the same decoder again,
fed projected thinker states instead of token embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from omnistage.layers.mrope import MRotaryEmbedding
from omnistage.models.config import ModelConfig
from omnistage.models.loader import build_and_load, checkpoint_names
from omnistage.models.qwen2 import Qwen2ForCausalLM

ARCHITECTURE = "Qwen2_5OmniForConditionalGeneration"
DEFAULT_MROPE_SECTION = (16, 24, 24)   # the reference's default when rope_parameters has none


@dataclass(frozen=True, slots=True)
class Qwen2_5OmniDecoderConfig:
    """The thinker's or the talker's decoder. `model` is what the AR engine reads; the rest
    is what only these models need."""

    model: ModelConfig
    mrope_section: tuple[int, int, int]

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig, decoder: PretrainedConfig,
                eos_token_ids: tuple[int, ...]) -> Qwen2_5OmniDecoderConfig:
        """`decoder`: the whole checkpoint's thinker_config.text_config or talker_config."""
        if getattr(hf_config, "model_type", None) != "qwen2_5_omni":
            raise ValueError(f"config.json model_type {getattr(hf_config, 'model_type', None)!r}"
                             f": expected 'qwen2_5_omni' ({ARCHITECTURE})")
        model = ModelConfig.from_hf(decoder, architecture=ARCHITECTURE)
        dtype = str(getattr(hf_config, "dtype", None) or "float32").removeprefix("torch.")
        section = (decoder.rope_parameters or {}).get("mrope_section") or DEFAULT_MROPE_SECTION
        return cls(model=replace(model, torch_dtype=dtype, eos_token_ids=eos_token_ids),
                   mrope_section=tuple(int(s) for s in section))  # type: ignore[arg-type]

    @classmethod
    def thinker(cls, hf_config: PretrainedConfig,
                generation_config: GenerationConfig | None = None) -> Qwen2_5OmniDecoderConfig:
        text = hf_config.thinker_config.text_config
        eos = getattr(generation_config, "eos_token_id", None)
        eos = eos if eos is not None else getattr(text, "eos_token_id", None)
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls.from_hf(hf_config, text, eos)

    def rotary_embedding(self) -> MRotaryEmbedding:
        mc = self.model
        return MRotaryEmbedding(mc.head_dim, mc.max_position_embeddings, mc.rope_parameters,
                                self.mrope_section, interleaved=False)


class Qwen2_5OmniThinkerForCausalLM(Qwen2ForCausalLM):
    # the part of the checkpoint this model loads: thinker.* except the encoders
    checkpoint_prefix = "thinker."
    checkpoint_exclude = ("audio_tower.", "visual.")
    uses_mrope = True               # the runner passes (3, T) positions

    def __init__(self, config: Qwen2_5OmniDecoderConfig) -> None:
        super().__init__(config.model, config.rotary_embedding())

    @property
    def model_config(self) -> ModelConfig:
        return self.config

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Qwen2_5OmniThinkerForCausalLM:
        """Build from config.json (thinker_config.text_config) and load `thinker.model.*` and
        `thinker.lm_head.*` strictly; dtype None: the checkpoint's."""
        path = Path(path)
        generation_config = None
        if (path / "generation_config.json").is_file():
            generation_config = GenerationConfig.from_pretrained(path)
        config = Qwen2_5OmniDecoderConfig.thinker(AutoConfig.from_pretrained(path),
                                                  generation_config)
        return build_and_load(cls, config, config.model, path, device, dtype)

    def checkpoint_names(self) -> set[str]:
        return checkpoint_names(self, self.packed_modules)


def thinker_embedding_rows(path: str | Path, token_ids: list[int]) -> Tensor:
    """(len(token_ids), hidden) float32 rows of the thinker's token embedding, read one by one
    from the checkpoint (the talker's text specials: eos, pad, each speaker's bos) without
    loading the whole table."""
    name = "thinker.model.embed_tokens.weight"
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            if name in f.keys():
                table = f.get_slice(name)
                return torch.cat([table[i:i + 1] for i in token_ids]).float()
    raise ValueError(f"{path}: the checkpoint has no {name}")
