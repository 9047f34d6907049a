"""CosyVoice3's hyperparameters, read from the checkpoint folder's cosyvoice3.yaml.

The released file is HyperPyYAML: `!new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT` maps
become the constructor arguments of that class, `!ref <name>` points at a top-level key (and
may multiply two: `!ref <chunk_size> * <token_mel_ratio>`). We never import or construct the
tagged classes: the tags are dropped, the maps kept, the references resolved, and the fields
our modules need are copied into frozen records (the upstream class defaults where the file is
silent, as upstream's constructors have them).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True, slots=True)
class _Ref:
    expr: str


class _Loader(yaml.SafeLoader):
    pass


def _tagged(loader: _Loader, suffix: str, node: yaml.Node) -> Any:
    if suffix == "ref":
        return _Ref(loader.construct_scalar(node))
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_Loader.add_multi_constructor("!", _tagged)


def _resolve(value: Any, top: dict[str, Any]) -> Any:
    if isinstance(value, _Ref):
        names = re.findall(r"<([^>]+)>", value.expr)
        return math.prod(_resolve(top[n], top) for n in names) if len(names) > 1 \
            else _resolve(top[names[0]], top)
    if isinstance(value, dict):
        return {k: _resolve(v, top) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top) for v in value]
    return value


def read_hyperparameters(path: str | Path) -> dict[str, Any]:
    """The yaml's `flow` and `hift` maps (tags dropped, references resolved)."""
    raw = yaml.load(Path(path).read_text(), Loader=_Loader)
    return {k: _resolve(raw[k], raw) for k in ("flow", "hift", "sample_rate", "feat_extractor",
                                               "llm") if k in raw}


@dataclass(frozen=True, slots=True)
class DiTConfig:
    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: int
    mel_dim: int
    mu_dim: int
    spk_dim: int
    static_chunk_size: int


@dataclass(frozen=True, slots=True)
class FlowConfig:
    vocab_size: int
    input_size: int             # token embedding width (= mel channels in v3)
    output_size: int            # mel channels
    spk_embed_dim: int          # the speaker x-vector's width (CAM++: 192)
    token_mel_ratio: int
    pre_lookahead_len: int
    lookahead_channels: int
    inference_cfg_rate: float
    t_scheduler: str
    dit: DiTConfig

    @classmethod
    def from_yaml(cls, f: dict[str, Any]) -> FlowConfig:
        est, cfm = f["decoder"]["estimator"], f["decoder"]["cfm_params"]
        cfm = cfm.get("content", cfm)
        mel_dim = est.get("mel_dim", 80)
        dit = DiTConfig(dim=est["dim"], depth=est.get("depth", 8), heads=est.get("heads", 8),
                        dim_head=est.get("dim_head", 64), ff_mult=est.get("ff_mult", 4),
                        mel_dim=mel_dim, mu_dim=est.get("mu_dim") or mel_dim,
                        spk_dim=est.get("spk_dim") or 0,
                        static_chunk_size=est.get("static_chunk_size", 50))
        la = f["pre_lookahead_layer"]
        return cls(vocab_size=f.get("vocab_size", 4096), input_size=f.get("input_size", 512),
                   output_size=f.get("output_size", 80), spk_embed_dim=f.get("spk_embed_dim", 192),
                   token_mel_ratio=f.get("token_mel_ratio", 2),
                   pre_lookahead_len=f.get("pre_lookahead_len", 3),
                   lookahead_channels=la["channels"],
                   inference_cfg_rate=float(cfm["inference_cfg_rate"]),
                   t_scheduler=cfm.get("t_scheduler", "cosine"), dit=dit)


@dataclass(frozen=True, slots=True)
class HiFTConfig:
    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    n_fft: int
    hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    conv_pre_look_right: int
    f0_cond_channels: int

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsample_rates) * self.hop_len

    @classmethod
    def from_yaml(cls, h: dict[str, Any]) -> HiFTConfig:
        def nested(key: str) -> tuple[tuple[int, ...], ...]:
            return tuple(tuple(d) for d in h.get(key, [[1, 3, 5]] * 3))

        return cls(in_channels=h.get("in_channels", 80), base_channels=h.get("base_channels", 512),
                   nb_harmonics=h.get("nb_harmonics", 8), sampling_rate=h["sampling_rate"],
                   nsf_alpha=h.get("nsf_alpha", 0.1), nsf_sigma=h.get("nsf_sigma", 0.003),
                   nsf_voiced_threshold=h.get("nsf_voiced_threshold", 10),
                   upsample_rates=tuple(h["upsample_rates"]),
                   upsample_kernel_sizes=tuple(h["upsample_kernel_sizes"]),
                   n_fft=h["istft_params"]["n_fft"], hop_len=h["istft_params"]["hop_len"],
                   resblock_kernel_sizes=tuple(h.get("resblock_kernel_sizes", (3, 7, 11))),
                   resblock_dilation_sizes=nested("resblock_dilation_sizes"),
                   source_resblock_kernel_sizes=tuple(h["source_resblock_kernel_sizes"]),
                   source_resblock_dilation_sizes=nested("source_resblock_dilation_sizes"),
                   lrelu_slope=h.get("lrelu_slope", 0.1), audio_limit=h.get("audio_limit", 0.99),
                   conv_pre_look_right=h.get("conv_pre_look_right", 4),
                   f0_cond_channels=h["f0_predictor"].get("cond_channels", 512))


@dataclass(frozen=True, slots=True)
class MelConfig:
    """`feat_extractor` (matcha's mel_spectrogram): the flow's prompt mel of a clip."""
    rate: int = 24000
    n_fft: int = 1920
    hop: int = 480
    n_mels: int = 80
    fmin: float = 0.0
    fmax: float | None = 8000.0

    @classmethod
    def from_yaml(cls, f: dict[str, Any], rate: int) -> MelConfig:
        return cls(rate=int(f.get("sampling_rate", rate)), n_fft=int(f.get("n_fft", 1920)),
                   hop=int(f.get("hop_size", 480)), n_mels=int(f.get("num_mels", 80)),
                   fmin=float(f.get("fmin", 0)), fmax=f.get("fmax", 8000.0))


@dataclass(frozen=True, slots=True)
class CosyVoice3Config:
    flow: FlowConfig
    hift: HiFTConfig
    mel: MelConfig = MelConfig()

    @classmethod
    def from_folder(cls, path: str | Path) -> CosyVoice3Config:
        file = Path(path) / "cosyvoice3.yaml"
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no cosyvoice3.yaml (CosyVoice3's hyperparameters)")
        hp = read_hyperparameters(file)
        hift = HiFTConfig.from_yaml(hp["hift"])
        return cls(flow=FlowConfig.from_yaml(hp["flow"]), hift=hift,
                   mel=MelConfig.from_yaml(hp.get("feat_extractor") or {}, hift.sampling_rate))

    @property
    def speech_token_size(self) -> int:
        """The LM's speech vocabulary (the flow's token vocabulary: 6561 released)."""
        return self.flow.vocab_size
