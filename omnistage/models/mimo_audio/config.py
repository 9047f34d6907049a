"""MiMo-Audio's config.json (upstream MiMoAudioConfig, a Qwen2Config with audio fields) and
the three Qwen2 decoders it describes: the LLM, the patch encoder (`input_local_transformer`)
and the patch decoder (`local_transformer`), sized as upstream's `input_local_config` and
`local_config` size them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import Qwen2Config

from omnistage.models.config import ModelConfig

ARCH = "MiMoAudioForCausalLM"
_AUDIO_KEYS = ("speech_vocab_size", "speech_zeroemb_idx", "delay_pattern", "group_size",
               "audio_channels", "local_dim", "local_layers", "local_attn_heads",
               "local_ffn_dim", "local_attn_dropout", "input_local_layers", "input_local_dim",
               "input_full_attention")


def _per_channel(value: str | int, channels: int) -> tuple[int, ...]:
    if isinstance(value, str) and "-" in value:
        out = tuple(int(s) for s in value.split("-"))
        if len(out) != channels:
            raise ValueError(f"{value!r}: {len(out)} values for {channels} audio channels")
        return out
    return (int(value),) * channels


@dataclass(frozen=True)
class MiMoAudioConfig:
    llm: ModelConfig
    local: ModelConfig           # the patch decoder
    input_local: ModelConfig     # the patch encoder
    group_size: int              # audio frames per LLM position (a patch)
    audio_channels: int          # RVQ channels
    vocab_sizes: tuple[int, ...]
    empty_ids: tuple[int, ...]   # per channel: "no audio here"
    delays: tuple[int, ...]      # the patch decoder's per-channel delay pattern
    empty_idx: int               # the text id of a speech position (upstream args.empty_idx)
    input_full_attention: bool   # the patch encoder attends both ways within a patch

    @classmethod
    def from_dict(cls, d: dict, empty_idx: int) -> MiMoAudioConfig:
        c = int(d.get("audio_channels", 8))
        base = {k: v for k, v in d.items() if k not in _AUDIO_KEYS}
        base.update(use_sliding_window=False, sliding_window=None)
        local_dim = int(d.get("local_dim", 1024))
        in_dim = int(d.get("input_local_dim") or local_dim)
        heads = int(d.get("local_attn_heads", 64))

        def sub(**over) -> ModelConfig:
            return ModelConfig.from_hf(Qwen2Config(**{**base, **over}), architecture=ARCH)
        return cls(
            llm=sub(),
            local=sub(hidden_size=local_dim, num_hidden_layers=int(d.get("local_layers", 16)),
                      num_attention_heads=heads, num_key_value_heads=heads,
                      head_dim=local_dim // heads,
                      intermediate_size=int(d.get("local_ffn_dim", 4096))),
            input_local=sub(hidden_size=in_dim,
                            num_hidden_layers=int(d.get("input_local_layers", 6)),
                            num_attention_heads=heads, num_key_value_heads=heads,
                            head_dim=in_dim // heads, intermediate_size=in_dim * 4),
            group_size=int(d.get("group_size", 4)), audio_channels=c,
            vocab_sizes=_per_channel(d.get("speech_vocab_size", "1025-1025-129-129-129-129-129-129"), c),
            empty_ids=_per_channel(d.get("speech_zeroemb_idx", "1024-1024-128-128-128-128-128-128"), c),
            delays=_per_channel(d.get("delay_pattern", "0-1-2-3-4-5-6-7"), c),
            empty_idx=empty_idx, input_full_attention=bool(d.get("input_full_attention")))

    @classmethod
    def from_folder(cls, path: str | Path, empty_idx: int) -> MiMoAudioConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()), empty_idx)
