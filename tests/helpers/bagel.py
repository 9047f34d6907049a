"""The tiny BAGEL checkpoint of tests/fixtures/bagel/, rebuilt from its manifest: the same
tensors scripts/bagel_fixtures.py drew from the seed (same rule, same order), written in the
checkpoint folder's layout (llm_config.json, vit_config.json, config.json, ema.safetensors,
ae.safetensors)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FIXTURES = Path(__file__).parents[1] / "fixtures" / "bagel"


def manifest() -> dict:
    return json.loads((FIXTURES / "manifest.json").read_text())


def expected() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "expected.safetensors"))


def seeded_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """scripts/bagel_fixtures.py's rule: norms' 1-D weights near 1, biases small, matrices
    scaled by 1/sqrt(fan_in)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1:
        return 1.0 + 0.1 * x if name.endswith("weight") else 0.05 * x
    return x / math.prod(shape[1:]) ** 0.5


def seeded_state(shapes: dict[str, list[int]], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: seeded_value(n, tuple(shapes[n]), gen) for n in sorted(shapes)}


def write_checkpoint(folder: Path) -> Path:
    """The tiny checkpoint in `folder`; its tensors' sums are checked against the manifest."""
    m = manifest()
    folder.mkdir(parents=True, exist_ok=True)
    ema, ae = seeded_state(m["ema"], m["seed"]), seeded_state(m["ae"], m["seed"] + 1)
    for state, key in ((ema, "ema_abs_sum"), (ae, "ae_abs_sum")):
        total = sum(float(v.double().abs().sum()) for _, v in sorted(state.items()))
        assert math.isclose(total, m[key], rel_tol=1e-9), (key, total, m[key])
    (folder / "llm_config.json").write_text(json.dumps(m["llm_config"]))
    (folder / "vit_config.json").write_text(json.dumps(m["vit_config"]))
    (folder / "config.json").write_text(json.dumps(m["bagel_config"]))
    save_file(ema, str(folder / "ema.safetensors"))
    save_file(ae, str(folder / "ae.safetensors"))
    return folder


class ByteTokenizer:
    """The fixtures' tokenizer (scripts/bagel_fixtures.py's stand-in): ids 0-255 bytes, then the
    four special tokens; decode writes an id below 256 as chr(id), as the upstream run did."""
    unk_token_id = None
    NAMES = {"<|im_start|>": "bos_token_id", "<|im_end|>": "eos_token_id",
             "<|vision_start|>": "start_of_image", "<|vision_end|>": "end_of_image"}

    def __init__(self, special: dict[str, int] | None = None) -> None:
        special = special or manifest()["special_tokens"]
        self.ids = {name: special[key] for name, key in self.NAMES.items()}
        self.text = {i: name for name, i in self.ids.items()}

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.ids[token]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return "".join(self.text.get(int(i), chr(int(i))) for i in ids)
