"""Qwen2.5-VL's vision tower (HF `Qwen2_5_VisionTransformerPretrainedModel`) in plain PyTorch,
loaded from the `visual.*` (or `model.visual.*`) tensors of a Qwen2_5_VLForConditionalGeneration
folder: what Qwen-Image-Edit's text encoder sees its input images through.

    pixel_values (N, C*tp*p*p): patches in merge-block order, as the Qwen2-VL processor emits
      -> patch_embed (Conv3d, kernel = stride = patch, no bias: a linear over each row)
      -> reorder into windows (below), the 2-D rotary with it
      -> depth x [RMSNorm -> attention -> RMSNorm -> gated SiLU MLP]; the blocks in
         fullatt_block_indexes attend over a whole frame, the others within their window
      -> merger: RMSNorm -> group m*m neighbours -> MLP -> (N / m^2, out_hidden_size)
      -> back to merge-block order

Windows: the merged grid (h/m, w/m) of a frame is cut into squares of
window_size / patch_size / m merged tokens a side (the last row and column of squares may be
smaller), listed row by row; each square's merged tokens keep their raster order, and each
merged token keeps its m*m patches together:

    merged grid 4x4, windows 2x2:   0  1 | 2  3       window order:  0 1 4 5 | 2 3 6 7 |
                                    4  5 | 6  7                      8 9 12 13 | 10 11 14 15
                                    -----+-----
                                    8  9 | 10 11
                                    12 13| 14 15

The blocks (attention), the patch embedding and the rotary are Qwen3-VL's
(qwen3_omni/vision_encoder.py); what differs here is the windows, RMSNorm, the gated MLP and
the merger's norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.norm import RMSNorm
from omnistage.models.qwen3_omni.vision_encoder import (PatchEmbed, VisionBlock, VisionSizes,
                                                        _grid_list, checked_grids,
                                                        frame_segments, vision_rope)
from omnistage.models.text_encoders.common import (build_on, checkpoint_dtype,
                                                   load_weights_strict, read_hf_config,
                                                   strip_prefix)

VISION_PREFIXES = ("model.visual.", "visual.")
OTHER_PREFIXES = ("model.", "lm_head.")      # the language model and its head, once stripped


@dataclass(frozen=True, slots=True)
class Qwen2_5_VisionConfig(VisionSizes):
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float

    @classmethod
    def from_hf(cls, hf) -> Qwen2_5_VisionConfig:
        """From transformers' `Qwen2_5_VLVisionConfig` (a Qwen2.5-VL config's vision_config)."""
        if hf.hidden_act != "silu":
            raise ValueError(f"vision_config.hidden_act {hf.hidden_act!r}: Qwen2.5-VL uses "
                             "'silu'")
        rope = getattr(hf, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters {rope}: only 'axial' is supported")
        head_dim = hf.hidden_size // hf.num_heads
        if hf.hidden_size % hf.num_heads or head_dim % 4:
            raise ValueError(f"vision_config: head_dim = hidden_size {hf.hidden_size} / "
                             f"num_heads {hf.num_heads} must be a multiple of 4 (2-D rotary)")
        return cls(depth=hf.depth, hidden_size=hf.hidden_size,
                   intermediate_size=hf.intermediate_size, num_heads=hf.num_heads,
                   in_channels=hf.in_channels, patch_size=hf.patch_size,
                   temporal_patch_size=hf.temporal_patch_size,
                   spatial_merge_size=hf.spatial_merge_size, out_hidden_size=hf.out_hidden_size,
                   window_size=hf.window_size,
                   fullatt_block_indexes=tuple(hf.fullatt_block_indexes),
                   rope_theta=float(rope.get("rope_theta", 10000.0)))


def window_layout(grids: list[tuple[int, int, int]], merge: int, window: int
                  ) -> tuple[Tensor, list[int]]:
    """(merged-token order into windows (N / m^2,), cumulative window lengths in patches),
    `window` merged tokens a side; empty windows are left out (HF's unique_consecutive)."""
    order, cu, start = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        for frame in index:
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    block = frame[r:r + window, c:c + window].reshape(-1)
                    order.append(block + start)
                    cu.append(cu[-1] + block.numel() * merge * merge)
        start += t * gh * gw
    return torch.cat(order), cu


class Qwen2_5_VLMLP(nn.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5_VLPatchMerger(nn.Module):
    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        self.group_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, eps=1e-6)
        # "mlp.0" / "mlp.2" as in the checkpoint (index 1 is the parameterless GELU)
        self.mlp = nn.Sequential(nn.Linear(self.group_dim, self.group_dim), nn.GELU(),
                                 nn.Linear(self.group_dim, cfg.out_hidden_size))

    def forward(self, x: Tensor) -> Tensor:                      # x: (N, hidden)
        return self.mlp(self.ln_q(x).view(-1, self.group_dim))   # (N / m^2, out_hidden)


class Qwen2_5_VisionTransformer(nn.Module):
    """`forward(pixel_values (N, C*tp*p*p), grid_thw (num_images, 3)) -> (N / m^2,
    out_hidden)`: every image's merged tokens, image after image."""

    def __init__(self, cfg: Qwen2_5_VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg, RMSNorm, Qwen2_5_VLMLP(cfg))
                                    for _ in range(cfg.depth))
        self.merger = Qwen2_5_VLPatchMerger(cfg)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Qwen2_5_VisionTransformer:
        """The vision tower of a Qwen2.5-VL folder (strict: every `visual` tensor, no other)."""
        path = Path(path)
        cfg = Qwen2_5_VisionConfig.from_hf(read_hf_config(path).vision_config)
        model = build_on(cls, cfg, device, dtype or checkpoint_dtype(path))
        load_weights_strict(model, path, lambda n: strip_prefix(n, VISION_PREFIXES),
                            ignored_prefixes=OTHER_PREFIXES)
        return model.eval().requires_grad_(False)

    def num_tokens(self, grid_thw: Tensor) -> list[int]:
        """Output tokens of every image: t * h * w / m^2."""
        m2 = self.cfg.spatial_merge_size ** 2
        return [t * h * w // m2 for t, h, w in _grid_list(grid_thw)]

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> Tensor:
        cfg = self.cfg
        grids, m = checked_grids(cfg, pixel_values, grid_thw), cfg.spatial_merge_size
        order, cu_windows = window_layout(grids, m, cfg.window_size // m // cfg.patch_size)
        order = order.to(pixel_values.device)

        def windowed(x: Tensor) -> Tensor:                       # rows in window order
            return x.view(-1, m * m, *x.shape[1:])[order].flatten(0, 1)

        x = windowed(self.patch_embed(pixel_values))             # (N, hidden)
        cos, sin = vision_rope(grids, cfg.head_dim, m, cfg.rope_theta, x.device)
        rope = windowed(cos), windowed(sin)                      # (N, 1, D) each
        cu_frames = frame_segments(grids)
        for idx, block in enumerate(self.blocks):
            x = block(x, cu_frames if idx in cfg.fullatt_block_indexes else cu_windows, rope)
        return self.merger(x)[torch.argsort(order)]              # (N / m^2, out_hidden)
