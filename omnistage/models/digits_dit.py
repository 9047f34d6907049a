"""DigitsDiT: a tiny class-conditional flow-matching DiT for 8x8 handwritten digits.

The engine's built-in demo model, trained by `scripts/train_digits.py` on scikit-learn's
`load_digits` (1797 images, pixels 0..16 scaled to [-1, 1]); the weights ship in
`omnistage/assets/digits_dit/`.

Rectified flow, as in diffusers' FlowMatchEulerDiscreteScheduler (SD3, FLUX):

    x_t = (1 - t) * x0 + t * noise        t = 0: data, t = 1: pure noise
    v   = model(x_t, t, label) ~ noise - x0
    sampling: t goes 1 -> 0 with Euler steps  x <- x + (t_next - t) * v

    image (B,1,8,8) -> patches (B,16,4) -> tokens (B,16,hidden) + pos
    t -> sinusoid -> MLP --+
    label -> embedding ----+-> c (B,hidden) -> adaLN-Zero blocks -> final layer -> (B,1,8,8)

Label `num_classes` (10) is the "null" class for classifier-free guidance.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file
from torch import Tensor, nn

from omnistage.layers.step_cache import CacheGroup, run_cached

if TYPE_CHECKING:
    from PIL import Image

ARCHITECTURE = "DigitsDiT"
MODEL_TYPE = "digits_dit"
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_FREQ_DIM = 256          # width of the sinusoidal timestep features
_T_SCALE = 1000.0        # t in [0, 1] is scaled to DiT's 0..1000 range before the sinusoid
_DIGIT_RE = re.compile(r"\b(?:[0-9]|" + "|".join(DIGIT_WORDS) + r")\b", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class DigitsDiTConfig:
    image_size: int = 8
    channels: int = 1
    patch_size: int = 2
    hidden_size: int = 96
    num_layers: int = 4
    num_heads: int = 4
    mlp_ratio: float = 2.0
    num_classes: int = 10    # the embedding table has one more row: the null class

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of "
                             f"patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of "
                             f"num_heads {self.num_heads}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch_size ** 2

    @classmethod
    def from_json(cls, text: str) -> DigitsDiTConfig:
        raw = json.loads(text)
        if raw.pop("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"config.json: model_type is not {MODEL_TYPE!r}")
        raw.pop("architectures", None)
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(raw) - known):
            raise ValueError(f"config.json: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps({"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
                           **asdict(self)}, indent=2) + "\n"


def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    """(B,) -> (B, dim) sinusoidal features, cos half then sin half, as in DiT."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]                        # (B, half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]               # x: (B,N,h), shift: (B,h)


class DigitsDiTAttention(nn.Module):
    def __init__(self, cfg: DigitsDiTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).view(B, N, 3, self.num_heads, C // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                       # each (B, H, N, D)
        out = F.scaled_dot_product_attention(q, k, v)              # (B, H, N, D)
        return self.proj(out.transpose(1, 2).reshape(B, N, C))     # (B, N, hidden)


class DigitsDiTMLP(nn.Module):
    def __init__(self, cfg: DigitsDiTConfig) -> None:
        super().__init__()
        inner = int(cfg.hidden_size * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.hidden_size, inner)
        self.fc2 = nn.Linear(inner, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))  # (B,N,h) -> (B,N,I) -> (B,N,h)


class DigitsDiTBlock(nn.Module):
    """Pre-norm attention + MLP; the condition gives each branch a shift, scale and gate
    (adaLN-Zero: the gates start at zero, so every block starts as the identity)."""

    def __init__(self, cfg: DigitsDiTConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.attn = DigitsDiTAttention(cfg)
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = DigitsDiTMLP(cfg)
        self.modulation = nn.Linear(h, 6 * h)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(c)).chunk(6, -1)
        x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1))
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class DigitsDiTFinalLayer(nn.Module):
    def __init__(self, cfg: DigitsDiTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=False, eps=1e-6)
        self.modulation = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size)
        self.linear = nn.Linear(cfg.hidden_size, cfg.patch_dim)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.modulation(F.silu(c)).chunk(2, -1)
        return self.linear(modulate(self.norm(x), shift, scale))   # (B, N, C*p*p)


class DigitsDiT(nn.Module):
    def __init__(self, cfg: DigitsDiTConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.patch_embed = nn.Linear(cfg.patch_dim, h)
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.num_patches, h))
        self.t_embed = nn.Sequential(nn.Linear(_FREQ_DIM, h), nn.SiLU(), nn.Linear(h, h))
        self.label_embed = nn.Embedding(cfg.num_classes + 1, h)
        self.blocks = nn.ModuleList(DigitsDiTBlock(cfg) for _ in range(cfg.num_layers))
        self.final = DigitsDiTFinalLayer(cfg)
        self._init_weights()

    @property
    def null_label(self) -> int:
        return self.config.num_classes

    def _init_weights(self) -> None:
        """DiT's initialisation: xavier linears, small embeddings, zeroed adaLN and output."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.label_embed.weight, std=0.02)
        for lin in (self.t_embed[0], self.t_embed[2]):
            nn.init.normal_(lin.weight, std=0.02)
        for zeroed in [*(b.modulation for b in self.blocks), self.final.modulation,
                       self.final.linear]:
            nn.init.zeros_(zeroed.weight)
            nn.init.zeros_(zeroed.bias)

    def patchify(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        p = self.config.patch_size
        x = x.view(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)  # (B, h, w, C, p, p)
        return x.reshape(B, (H // p) * (W // p), C * p * p)               # (B, N, C*p*p)

    def unpatchify(self, x: Tensor) -> Tensor:
        cfg = self.config
        B, p, g = x.shape[0], cfg.patch_size, cfg.image_size // cfg.patch_size
        x = x.view(B, g, g, cfg.channels, p, p).permute(0, 3, 1, 4, 2, 5)  # (B, C, h, p, w, p)
        return x.reshape(B, cfg.channels, cfg.image_size, cfg.image_size)

    def forward(self, x: Tensor, t: Tensor, labels: Tensor) -> Tensor:
        """x: (B,C,H,W) noisy images, t: (B,) in [0,1], labels: (B,) int64 in 0..num_classes
        -> velocity (B,C,H,W)."""
        tokens = self.patch_embed(self.patchify(x)) + self.pos_embed       # (B, N, hidden)
        c = self.t_embed(timestep_embedding(t * _T_SCALE, _FREQ_DIM)) + self.label_embed(labels)
        for block in self.blocks:
            tokens = block(tokens, c)                                       # (B, N, hidden)
        return self.unpatchify(self.final(tokens, c))                       # (B, C, H, W)

    # TeaCache rescaling: identity (not fitted; the demo's 8x8 images need no tuning)
    step_cache_coefficients: tuple[float, ...] = (1.0, 0.0)

    def forward_cached(self, x: Tensor, t: Tensor, labels: Tensor,
                       groups: list[CacheGroup]) -> Tensor:
        """forward() with step caching (layers/step_cache.py); `groups` split the batch rows by
        request and branch, each with its cache state."""
        tokens = self.patch_embed(self.patchify(x)) + self.pos_embed       # (B, N, hidden)
        c = self.t_embed(timestep_embedding(t * _T_SCALE, _FREQ_DIM)) + self.label_embed(labels)
        first = self.blocks[0]
        shift1, scale1 = first.modulation(F.silu(c)).chunk(6, -1)[:2]
        modulated = modulate(first.norm1(tokens), shift1, scale1)          # (B, N, hidden)

        def run_blocks(idx: Tensor) -> Tensor:
            h = tokens[idx]
            for block in self.blocks:
                h = block(h, c[idx])
            return h

        out = run_cached(tokens, modulated, groups, self.step_cache_coefficients, run_blocks)
        return self.unpatchify(self.final(out, c))                           # (B, C, H, W)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None) -> DigitsDiT:
        """Load `config.json` + `model.safetensors` from a folder; None: the shipped weights.
        Every tensor must be present, known and of the right shape."""
        folder: Path | Traversable = (Path(path) if path is not None
                                      else resources.files("omnistage") / "assets" / MODEL_TYPE)
        for name in ("config.json", "model.safetensors"):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{folder}: no {name}")
        model = cls(DigitsDiTConfig.from_json((folder / "config.json").read_text()))
        tensors = load_safetensors((folder / "model.safetensors").read_bytes())
        expected = model.state_dict()
        if missing := sorted(set(expected) - set(tensors)):
            raise ValueError(f"{folder}/model.safetensors: missing tensors: {', '.join(missing)}")
        if unexpected := sorted(set(tensors) - set(expected)):
            raise ValueError(f"{folder}/model.safetensors: unexpected tensors: "
                             f"{', '.join(unexpected)}")
        for name, tensor in tensors.items():
            if tensor.shape != expected[name].shape:
                raise ValueError(f"{folder}/model.safetensors: tensor {name!r} has shape "
                                 f"{tuple(tensor.shape)}, the model expects "
                                 f"{tuple(expected[name].shape)}")
        model.load_state_dict({k: v.float() for k, v in tensors.items()})
        return model.eval()

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float32) -> None:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(self.config.to_json())
        tensors = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def parse_digit(prompt: str) -> int:
    """The one digit a prompt names, as a numeral or a word: "a handwritten seven" -> 7.
    Whole words only ("someone" names no digit); naming the same digit twice is fine."""
    found = {int(m) if m.isdigit() else DIGIT_WORDS.index(m.lower())
             for m in _DIGIT_RE.findall(prompt)}
    if not found:
        raise ValueError(f"prompt names no digit (0-9 or zero..nine): {prompt!r}")
    if len(found) > 1:
        raise ValueError(f"prompt names more than one digit {sorted(found)}: {prompt!r}")
    return found.pop()


@torch.no_grad()
def sample(model: DigitsDiT, labels: Tensor, num_steps: int = 20, guidance_scale: float = 2.0,
           generator: torch.Generator | None = None) -> Tensor:
    """Reference sampler: Euler from t=1 to t=0 on uniform steps, classifier-free guidance
    with the conditional and null-label halves in one batch. labels: (B,) -> (B,C,H,W) in [-1,1]."""
    cfg = model.config
    device = next(model.parameters()).device
    B = labels.shape[0]
    x = torch.randn(B, cfg.channels, cfg.image_size, cfg.image_size, generator=generator,
                    device=device)
    both = torch.cat([labels.to(device), torch.full((B,), model.null_label, device=device)])
    ts = torch.linspace(1.0, 0.0, num_steps + 1, device=device)
    for t, t_next in zip(ts[:-1], ts[1:]):
        v_cond, v_null = model(torch.cat([x, x]), t.expand(2 * B), both).chunk(2)
        v = v_null + guidance_scale * (v_cond - v_null)                # (B, C, H, W)
        x = x + (t_next - t) * v
    return x.clamp(-1.0, 1.0)


def to_pil(images: Tensor, scale: int = 8) -> list[Image.Image]:
    """(B,1,H,W) in [-1,1] -> grayscale PIL images, upscaled `scale`x with nearest neighbour;
    ink is white on black, as in MNIST. Needs Pillow, which the engine itself does not."""
    from PIL import Image

    pixels = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    out = []
    for img in pixels[:, 0].numpy():                                   # (H, W) uint8
        pil = Image.fromarray(img)                                      # mode "L"
        out.append(pil.resize((pil.width * scale, pil.height * scale), Image.Resampling.NEAREST))
    return out
