"""The tiny HunyuanVideo-1.5 super-resolution checkpoints of tests/fixtures/hunyuan_video15_sr/
(scripts/hunyuan_video15_sr_fixtures.py made them with the upstream code): rebuilt in the
released layout (transformer/<version>/, upsampler/<version>/: config.json +
diffusion_pytorch_model.safetensors under the upstream's names) from the manifest's seeds,
names and shapes, with the script's `seeded_value` rule."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hunyuan_video15_sr"


@lru_cache(maxsize=1)
def manifest() -> dict:
    return json.loads((FIXTURES / "manifest.json").read_text())


@lru_cache(maxsize=1)
def expected() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "expected.safetensors"))


def seeded_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * x if name.endswith(("weight", "gamma")) else 0.05 * x
    return x / int(np.prod(shape[1:])) ** 0.5


def build_checkpoint(root: Path) -> Path:
    """Every folder of the manifest under root (the released layout); returns root."""
    m = manifest()
    for folder, entry in m["checkpoints"].items():
        out = root / folder
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(entry["config"]))
        gen = torch.Generator().manual_seed(m["seeds"][folder])
        state = {n: seeded_value(n, tuple(s), gen) for n, s in sorted(entry["tensors"])}
        save_file(state, str(out / "diffusion_pytorch_model.safetensors"))
    return root


def text_inputs() -> dict[str, torch.Tensor]:
    """The transformer's text keyword inputs: the fixture's Qwen / byT5 states with masks."""
    exp = expected()
    return {"encoder_hidden_states": exp["text.prompt_embeds"],
            "encoder_attention_mask": exp["text.prompt_mask"],
            "encoder_hidden_states_2": exp["text.byt5_states"],
            "encoder_attention_mask_2": exp["text.byt5_mask"]}
