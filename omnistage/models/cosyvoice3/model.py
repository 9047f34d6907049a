"""Loading a CosyVoice3 checkpoint folder as released (FunAudioLLM/Fun-CosyVoice3-0.5B-2512):

    cosyvoice3.yaml    hyperparameters (HyperPyYAML; config.py reads it without the classes)
    flow.pt            CausalMaskedDiffWithDiT's state dict   -> flow.CausalMaskedDiffWithDiT
    hift.pt            CausalHiFTGenerator's state dict       -> hift.CausalHiFTGenerator
    llm.pt, campplus.onnx, speech_tokenizer_v3.onnx, CosyVoice-BlankEN/   not read here yet

Weight-normed convs are stored as `<conv>.parametrizations.weight.original0` (the gain g) and
`original1` (the direction v), or by older torch as `weight_g` / `weight_v`; both are folded
into `<conv>.weight` = g * v / |v| (norm over every dimension but the first), which is what the
reference computes at every call. Loading is strict: a missing, unexpected or mis-shaped tensor
raises ValueError naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.models.cosyvoice3.config import CosyVoice3Config
from omnistage.models.cosyvoice3.flow import CausalMaskedDiffWithDiT
from omnistage.models.cosyvoice3.hift import CausalHiFTGenerator

_WEIGHT_NORM = ((".parametrizations.weight.original0", ".parametrizations.weight.original1"),
                (".weight_g", ".weight_v"))


def fold_weight_norm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    out = dict(state)
    for g_suffix, v_suffix in _WEIGHT_NORM:
        for name in [n for n in state if n.endswith(g_suffix)]:
            conv = name[: -len(g_suffix)]
            g, v = out.pop(name), out.pop(conv + v_suffix)
            norm = v.norm(dim=tuple(range(1, v.dim())), keepdim=True)
            out[conv + ".weight"] = g * v / norm
    return out


def load_state(module: nn.Module, file: Path) -> None:
    if not file.is_file():
        raise FileNotFoundError(f"{file.parent}: no {file.name}")
    state = fold_weight_norm(torch.load(file, map_location="cpu", weights_only=True))
    want = module.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"{file}: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(want[name].shape):
            raise ValueError(f"{file}: {name} has shape {tuple(tensor.shape)}, "
                             f"the config gives {tuple(want[name].shape)}")
    module.load_state_dict(state, strict=True)


class CosyVoice3(nn.Module):
    """The flow and the vocoder of a CosyVoice3 folder, in float32."""

    def __init__(self, cfg: CosyVoice3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.flow = CausalMaskedDiffWithDiT(cfg.flow)
        self.hift = CausalHiFTGenerator(cfg.hift)

    @property
    def sample_rate(self) -> int:
        return self.cfg.hift.sampling_rate

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu"
                        ) -> CosyVoice3:
        path = Path(path)
        model = cls(CosyVoice3Config.from_folder(path))
        load_state(model.flow, path / "flow.pt")
        load_state(model.hift, path / "hift.pt")
        return model.to(device).eval()
