"""Voxtral-TTS's configuration as Mistral ships it: `params.json` (the backbone's sizes at the
top level, `multimodal.audio_model_args` for the generation head and the packed audio embedding,
`multimodal.audio_tokenizer_args` for the codec and the preset voices) next to
`consolidated.safetensors`. There is no config.json; transformers has no class for it.

Codes in the LLM's space are the codec's codes + 2: 0 is [EMPTY_AUDIO], 1 is [END_AUDIO]
(semantic codebook only; the acoustic codebooks keep the two slots unused)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

EMPTY_AUDIO = 0
END_AUDIO = 1
N_SPECIALS = 2


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(i) for i in s.split(","))


@dataclass(frozen=True)
class HeadConfig:
    """The flow-matching head (`acoustic_transformer.*`) and the packed audio table."""
    semantic_codebook_size: int = 8192
    acoustic_codebook_size: int = 21
    n_acoustic_codebook: int = 36
    input_dim: int = 3072
    dim: int = 3072
    n_layers: int = 3
    head_dim: int = 128
    hidden_dim: int = 9216
    n_heads: int = 32
    n_kv_heads: int = 8
    use_biases: bool = False
    norm_eps: float = 1e-5
    n_decoding_steps: int = 7      # absent from the release's params.json; vLLM-Omni's default
    audio_token_id: int = 24
    begin_audio_token_id: int = 25

    @property
    def semantic_out_size(self) -> int:      # specials + codes, padded to a multiple of 128
        return 128 * -(-(self.semantic_codebook_size + N_SPECIALS) // 128)

    @property
    def codebook_sizes(self) -> list[int]:  # with the 2 specials each, unpadded
        return [self.semantic_codebook_size + N_SPECIALS] + \
            [self.acoustic_codebook_size + N_SPECIALS] * self.n_acoustic_codebook

    @property
    def packed_table_size(self) -> int:
        return 128 * -(-sum(self.codebook_sizes) // 128)


@dataclass(frozen=True)
class CodecConfig:
    """The codec's decoder side (`audio_tokenizer.*`; the release has no encoder weights)."""
    sampling_rate: int = 24000
    pretransform_patch_size: int = 240
    patch_proj_kernel_size: int = 7
    semantic_codebook_size: int = 8192
    semantic_dim: int = 256
    acoustic_codebook_size: int = 21
    acoustic_dim: int = 36
    dim: int = 1024
    hidden_dim: int = 4096
    head_dim: int = 128
    n_heads: int = 8
    n_kv_heads: int = 8
    qk_norm_eps: float = 1e-6
    norm_eps: float = 1e-2
    attn_sliding_window_size: int = 16
    half_attn_window_upon_downsampling: bool = True
    layer_scale: bool = True
    qk_norm: bool = True
    causal: bool = True
    use_biases: bool = False
    channels: int = 1
    encoder_convs_strides: tuple[int, ...] = (2, 2, 2, 1)
    decoder_transformer_lengths: tuple[int, ...] = (2, 2, 2, 2)
    decoder_convs_kernels: tuple[int, ...] = (3, 4, 4, 4)
    decoder_convs_strides: tuple[int, ...] = (1, 2, 2, 2)
    voices: dict[str, int] = field(default_factory=dict)

    @property
    def samples_per_frame(self) -> int:
        n = self.pretransform_patch_size
        for s in self.decoder_convs_strides:
            n *= s
        return n


def _pick(cls, d: dict, **extra) -> object:
    names = cls.__dataclass_fields__
    return cls(**{k: v for k, v in {**d, **extra}.items() if k in names})


def read_params(folder: str | Path) -> tuple[dict, HeadConfig, CodecConfig]:
    """params.json -> (the whole dict, head config, codec config); a missing block is a
    ValueError naming it."""
    path = Path(folder) / "params.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no params.json (a Mistral-format Voxtral-TTS folder)")
    params = json.loads(path.read_text())
    mm = params.get("multimodal") or {}
    if "audio_model_args" not in mm or "audio_tokenizer_args" not in mm:
        raise ValueError(f"{path}: multimodal.audio_model_args / audio_tokenizer_args missing")
    am = dict(mm["audio_model_args"])
    if "codebook_sizes" in am:                         # the older comma-separated form
        sizes = _ints(am.pop("codebook_sizes"))
        am.update(semantic_codebook_size=sizes[0], acoustic_codebook_size=sizes[1],
                  n_acoustic_codebook=len(sizes) - 1)
    at = {k: v for k, v in (am.get("acoustic_transformer_args") or {}).items() if v is not None}
    head = _pick(HeadConfig, am, **at)
    ca = dict(mm["audio_tokenizer_args"])
    lists = {k[: -len("_str")]: _ints(v) for k, v in ca.items() if k.endswith("_str")}
    codec = _pick(CodecConfig, ca, **lists, voices=dict(ca.get("voice") or {}))
    return params, head, codec


def load_consolidated(folder: str | Path, prefix: str, device: object = "cpu") -> dict[str, Tensor]:
    """The tensors of consolidated.safetensors under `prefix` (stripped)."""
    from safetensors import safe_open

    out: dict[str, Tensor] = {}
    with safe_open(str(Path(folder) / "consolidated.safetensors"), "pt", device=str(device)) as f:
        for k in f.keys():
            if k.startswith(prefix):
                out[k[len(prefix):]] = f.get_tensor(k)
    return out


def load_into(module: torch.nn.Module, state: dict[str, Tensor], where: str) -> None:
    """Copy `state` into module's parameters by name; a missing or misshapen tensor raises
    ValueError naming it."""
    for name, p in module.named_parameters():
        if name not in state:
            raise ValueError(f"{where}: missing {name}")
        if state[name].shape != p.shape:
            raise ValueError(f"{where}: {name} has shape {tuple(state[name].shape)}, "
                             f"expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(state[name])
