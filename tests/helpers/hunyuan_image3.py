"""The tiny HunyuanImage-3.0 checkpoint of tests/fixtures/hunyuan_image3/, rebuilt from its seed
(the weights are ~11 MB, so the fixture keeps the seed, names and shapes instead):
scripts/hunyuan_image3_fixtures.py drew every tensor with the same `seeded_value` rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hunyuan_image3"


def manifest() -> dict:
    return json.loads((FIXTURES / "manifest.json").read_text())


def expected() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "expected.safetensors"))


def seeded_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * x if name.endswith("weight") else 0.05 * x
    return x / int(np.prod(shape[1:])) ** 0.5


def build_checkpoint(folder: Path) -> Path:
    """config.json, model.safetensors and the tokenizer files of the fixture's tiny model."""
    m = manifest()
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(m["seed"])
    state = {n: seeded_value(n, tuple(s), gen) for n, s in sorted(m["tensors"])}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(m["config"], indent=1))
    (folder / "generation_config.json").write_text(json.dumps(m["generation_config"], indent=1))
    for f in m["tokenizer_files"]:
        shutil.copy(FIXTURES / f, folder / f)
    return folder
