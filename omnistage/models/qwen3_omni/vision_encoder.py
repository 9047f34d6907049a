"""Qwen3-Omni's vision encoder (HF `Qwen3OmniMoeVisionEncoder`, the Qwen3-VL ViT) in plain
PyTorch, loaded from the `thinker.visual.*` tensors of the one Qwen3-Omni checkpoint.

    pixel_values (N, C*tp*p*p): patches in merge-block order, as the Qwen2-VL processor emits
      -> patch_embed (a Conv3d with kernel = stride = patch, so a linear over each row)
      -> + learned positions: the (side, side) table bilinearly resized to each image's grid
      -> depth x [LN -> attention with 2-D rotary (h, w), one image frame a segment -> LN -> MLP]
         after the blocks in deepstack_visual_indexes: merger_list[j] -> deepstack feature j
      -> merger: LN -> group m*m neighbours -> MLP -> (N / m^2, out_hidden_size)

Merge-block order of one frame with grid h=4, w=4 and merge m=2 (row, col of each patch):

    (0,0) (0,1) (1,0) (1,1) | (0,2) (0,3) (1,2) (1,3) | (2,0) (2,1) (3,0) (3,1) | ...

so every m*m consecutive rows form one output token. Video frames (grid_t > 1) repeat the
frame layout; attention stays within one frame, as in HF.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.rotary import rotate_half
from omnistage.models.qwen3_omni.audio_encoder import (build_component, read_thinker_config,
                                                        varlen_attention)


class VisionSizes:
    """What the shared blocks (attention, patch embedding, VisionBlock) read of a Qwen-VL
    vision config: Qwen3-VL's below, Qwen2.5-VL's (qwen2_5_vl_vision.py)."""

    __slots__ = ()
    hidden_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


@dataclass(frozen=True, slots=True)
class VisionEncoderConfig(VisionSizes):
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision_config: head_dim = hidden_size {self.hidden_size} / "
                             f"num_heads {self.num_heads} must be a multiple of 4 (2-D rotary)")
        side = int(self.num_position_embeddings ** 0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision_config.num_position_embeddings "
                             f"{self.num_position_embeddings} is not a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"vision_config.deepstack_visual_indexes {bad} outside depth "
                             f"{self.depth}")

    @classmethod
    def from_hf(cls, vision_config) -> VisionEncoderConfig:
        """From transformers' `Qwen3OmniMoeVisionEncoderConfig` (thinker_config.vision_config)."""
        act = getattr(vision_config, "hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act {act!r}: only 'gelu_pytorch_tanh' is "
                             "supported")
        rope = getattr(vision_config, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: "
                             "only 'axial' is supported")
        for name in ("patch_size", "temporal_patch_size"):
            if not isinstance(getattr(vision_config, name), int):
                raise ValueError(f"vision_config.{name} {getattr(vision_config, name)!r}: only a "
                                 "single int is supported")
        names = [n for n in cls.__dataclass_fields__ if n not in ("rope_theta",)]
        values = {n: getattr(vision_config, n) for n in names}
        values["deepstack_visual_indexes"] = tuple(values["deepstack_visual_indexes"])
        return cls(**values, rope_theta=float(rope.get("rope_theta", 10000.0)))


def _grid_list(grid_thw: Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def checked_grids(cfg: VisionSizes, pixel_values: Tensor, grid_thw: Tensor
                  ) -> list[tuple[int, int, int]]:
    """The images' (t, h, w) patch grids, checked against the merge size and pixel_values."""
    grids, m = _grid_list(grid_thw), cfg.spatial_merge_size
    if any(h % m or w % m or t <= 0 for t, h, w in grids):
        raise ValueError(f"grid_thw {grids}: h and w must be multiples of spatial_merge_size "
                         f"{m} and t positive")
    num_patches = sum(t * h * w for t, h, w in grids)
    if pixel_values.shape != (num_patches, cfg.patch_dim):
        raise ValueError(f"pixel_values: expected ({num_patches}, {cfg.patch_dim}) for "
                         f"grid_thw {grids}, got {tuple(pixel_values.shape)}")
    return grids


def frame_segments(grids: list[tuple[int, int, int]]) -> list[int]:
    """Cumulative patch counts with one segment per frame: full attention stays in a frame."""
    cu_seqlens = [0]
    for t, h, w in grids:
        for _ in range(t):
            cu_seqlens.append(cu_seqlens[-1] + h * w)
    return cu_seqlens


def merge_block_order(h: int, w: int, m: int) -> Tensor:
    """Raster index of every patch of an (h, w) frame, listed in merge-block order: (h*w,)."""
    return torch.arange(h * w).view(h // m, m, w // m, m).permute(0, 2, 1, 3).reshape(-1)


def vision_rope(grids: list[tuple[int, int, int]], head_dim: int, merge: int, theta: float,
                device: torch.device) -> tuple[Tensor, Tensor]:
    """cos, sin (N, 1, head_dim) float32 of the Qwen-VL towers' 2-D rotary, patches in
    merge-block order: a quarter of the frequencies turn with the patch row, a quarter with
    the column, the halves repeated (Qwen2.5-VL and Qwen3-VL alike)."""
    quarter = head_dim // 2
    inv_freq = 1.0 / (theta ** (
        torch.arange(0, quarter, 2, dtype=torch.float32, device=device) / quarter))
    rows, cols = [], []
    for t, h, w in grids:
        order = merge_block_order(h, w, merge).to(device)
        rows.append((order // w).repeat(t))
        cols.append((order % w).repeat(t))
    row, col = torch.cat(rows).float(), torch.cat(cols).float()
    freqs = torch.cat([row[:, None] * inv_freq, col[:, None] * inv_freq], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]          # (N, 1, D)
    return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionSizes) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: Tensor, cu_seqlens: list[int], rope: tuple[Tensor, Tensor]) -> Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = rope                                           # (N, 1, D) float32 each
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(v.dtype)
        out = varlen_attention(q, k, v, cu_seqlens, self.head_dim ** -0.5)   # (N, H, D)
        return self.proj(out.reshape(x.shape))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP. Qwen3-VL's: LayerNorm and a GELU MLP; Qwen2.5-VL's tower
    (qwen2_5_vl_vision.py) gives its RMSNorm and gated MLP."""

    def __init__(self, cfg: VisionSizes, norm: type[nn.Module] = nn.LayerNorm,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1 = norm(cfg.hidden_size, eps=1e-6)
        self.norm2 = norm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = mlp if mlp is not None else VisionMLP(cfg)

    def forward(self, x: Tensor, cu_seqlens: list[int], rope: tuple[Tensor, Tensor]) -> Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rope)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """m*m neighbouring patches -> one token of out_hidden_size. The final merger normalises
    each patch before grouping; the deepstack mergers normalise the group after it."""

    def __init__(self, cfg: VisionEncoderConfig, norm_after_shuffle: bool) -> None:
        super().__init__()
        self.group_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm_after_shuffle = norm_after_shuffle
        self.ln_q = nn.LayerNorm(self.group_dim if norm_after_shuffle else cfg.hidden_size,
                                 eps=1e-6)
        # "mlp.0" / "mlp.2" as in the checkpoint (index 1 is the parameterless GELU)
        self.mlp = nn.ModuleList([nn.Linear(self.group_dim, self.group_dim), nn.GELU(),
                                  nn.Linear(self.group_dim, cfg.out_hidden_size)])

    def forward(self, x: Tensor) -> Tensor:                      # x: (N, hidden)
        if self.norm_after_shuffle:
            x = self.ln_q(x.view(-1, self.group_dim))
        else:
            x = self.ln_q(x).view(-1, self.group_dim)            # (N / m^2, m^2 * hidden)
        for layer in self.mlp:
            x = layer(x)
        return x                                                 # (N / m^2, out_hidden)


class PatchEmbed(nn.Module):
    """The Conv3d of the checkpoint (weight (hidden, C, tp, p, p)) applied as one matmul: its
    kernel covers a whole patch row of pixel_values, laid out (C, tp, p, p) too. Qwen2.5-VL's
    has no bias."""

    def __init__(self, cfg: VisionSizes, bias: bool = True) -> None:
        super().__init__()
        p, tp = cfg.patch_size, cfg.temporal_patch_size
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, (tp, p, p), (tp, p, p),
                              bias=bias)

    def forward(self, pixel_values: Tensor) -> Tensor:           # (N, C*tp*p*p)
        weight = self.proj.weight.view(self.proj.weight.shape[0], -1)
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)   # (N, hidden)


class VisionEncoder(nn.Module):
    """`forward(pixel_values (N, C*tp*p*p), grid_thw (num_images, 3)) -> (embeds
    (N / m^2, out_hidden), [deepstack (N / m^2, out_hidden)] * len(deepstack_visual_indexes))`."""

    def __init__(self, cfg: VisionEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, norm_after_shuffle=False)
        self.merger_list = nn.ModuleList(PatchMerger(cfg, norm_after_shuffle=True)
                                         for _ in cfg.deepstack_visual_indexes)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> VisionEncoder:
        """Load `thinker.visual.*` of a Qwen3-Omni checkpoint folder (strict)."""
        cfg = VisionEncoderConfig.from_hf(read_thinker_config(Path(path)).vision_config)
        return build_component(cls, cfg, Path(path), "thinker.visual.", device, dtype)

    def num_tokens(self, grid_thw: Tensor) -> list[int]:
        """Output tokens of every image / video: t * h * w / m^2."""
        m2 = self.cfg.spatial_merge_size ** 2
        return [t * h * w // m2 for t, h, w in _grid_list(grid_thw)]

    def _position_embeddings(self, grids: list[tuple[int, int, int]]) -> Tensor:
        """The (side, side) learned table resized bilinearly (align_corners=True) to each
        frame's (h, w), in merge-block order, repeated over t: (N, hidden) float32."""
        side = int(self.cfg.num_position_embeddings ** 0.5)
        table = self.pos_embed.weight
        out = []
        for t, h, w in grids:
            def taps(n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
                src = torch.arange(n, device=table.device, dtype=torch.float32) * \
                    ((side - 1) / max(n - 1, 1))
                lo = src.floor()
                frac = src - lo
                lo = lo.long()
                return lo, (lo + 1).clamp(max=side - 1), 1.0 - frac, frac
            r0, r1, wr0, wr1 = taps(h)
            c0, c1, wc0, wc1 = taps(w)
            index = torch.stack([r0[:, None] * side + c0, r0[:, None] * side + c1,
                                 r1[:, None] * side + c0, r1[:, None] * side + c1], dim=-1)
            weight = torch.stack([wr0[:, None] * wc0, wr0[:, None] * wc1,
                                  wr1[:, None] * wc0, wr1[:, None] * wc1], dim=-1)
            # float32 sum of the 4 taps, as HF (its weights are float32)
            pos = (table[index.view(h * w, 4)].float() * weight.view(h * w, 4, 1)).sum(1)
            order = merge_block_order(h, w, self.cfg.spatial_merge_size).to(table.device)
            out.append(pos[order].repeat(t, 1))                  # (t*h*w, hidden)
        return torch.cat(out)

    def forward(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
        cfg = self.cfg
        grids = checked_grids(cfg, pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)                       # (N, hidden)
        x = x + self._position_embeddings(grids).to(x.dtype)
        rope = vision_rope(grids, cfg.head_dim, cfg.spatial_merge_size, cfg.rope_theta, x.device)
        cu_seqlens = frame_segments(grids)

        deepstack = []
        for idx, block in enumerate(self.blocks):
            x = block(x, cu_seqlens, rope)
            if idx in cfg.deepstack_visual_indexes:
                merger = self.merger_list[cfg.deepstack_visual_indexes.index(idx)]
                deepstack.append(merger(x))                      # (N / m^2, out_hidden)
        return self.merger(x), deepstack
