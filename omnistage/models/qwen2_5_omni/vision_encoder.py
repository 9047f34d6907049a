"""Qwen2.5-Omni's vision encoder (HF `Qwen2_5OmniVisionEncoder`): the Qwen2.5-VL windowed ViT
with merger (qwen2_5_vl_vision.py), loaded from the `thinker.visual.*` tensors of the one
Qwen2.5-Omni checkpoint.

The one difference in the checkpoint: every block's attention keeps q, k and v as three
linears (`attn.q`, `attn.k`, `attn.v`) where Qwen2.5-VL has one `attn.qkv`; they are fused on
load, rows in q, k, v order, which is how the shared attention splits them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from omnistage.models.qwen2_5_vl_vision import Qwen2_5_VisionConfig, Qwen2_5_VisionTransformer
from omnistage.models.qwen3_omni.audio_encoder import build_component, read_thinker_config

QKV = ("q", "k", "v")


def fuse_qkv(tensors: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """`blocks.i.attn.{q,k,v}.{weight,bias}` -> `blocks.i.attn.qkv.{weight,bias}` (rows
    concatenated q, k, v); other tensors pass through. A piece without its two siblings raises
    ValueError naming it."""
    pending: dict[tuple[str, str], dict[str, Tensor]] = {}
    for name, tensor in tensors:
        head, piece, kind = (name.rsplit(".", 2) + ["", ""])[:3]
        if piece not in QKV or not head.endswith(".attn"):
            yield name, tensor
            continue
        group = pending.setdefault((head, kind), {})
        group[piece] = tensor
        if len(group) == len(QKV):
            del pending[(head, kind)]
            yield f"{head}.qkv.{kind}", torch.cat([group[p] for p in QKV])
    if pending:
        partial = sorted(f"{head}.{{{','.join(g)}}}.{kind}" for (head, kind), g in pending.items())
        raise ValueError(f"checkpoint: attention pieces without their q/k/v siblings: {partial}")


class Qwen2_5OmniVisionEncoder(Qwen2_5_VisionTransformer):
    """`forward(pixel_values (N, C*tp*p*p), grid_thw (num_items, 3)) -> (N / m^2,
    out_hidden)`, Qwen2.5-VL's tower."""

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> Qwen2_5OmniVisionEncoder:
        """Load `thinker.visual.*` of a Qwen2.5-Omni checkpoint folder (strict)."""
        cfg = Qwen2_5_VisionConfig.from_hf(read_thinker_config(Path(path)).vision_config)
        return build_component(cls, cfg, Path(path), "thinker.visual.", device, dtype,
                               rewrite=fuse_qkv)
