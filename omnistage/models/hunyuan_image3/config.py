"""The parts of HunyuanImage-3.0's config.json the text-to-image path reads, checked on load."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class VaeConfig:
    latent_channels: int
    out_channels: int
    block_out_channels: tuple[int, ...]
    layers_per_block: int
    ffactor_spatial: int
    ffactor_temporal: int
    scaling_factor: float
    shift_factor: float

    @classmethod
    def from_dict(cls, d: dict) -> VaeConfig:
        return cls(d["latent_channels"], d["out_channels"], tuple(d["block_out_channels"]),
                   d["layers_per_block"], d["ffactor_spatial"], d["ffactor_temporal"],
                   float(d.get("scaling_factor") or 1.0), float(d.get("shift_factor") or 0.0))


@dataclass(frozen=True, slots=True)
class HunyuanImage3Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    use_qk_norm: bool
    num_experts: int
    moe_topk: int
    moe_intermediate_size: int
    shared_intermediate_size: int      # 0: no shared MLP
    norm_topk_prob: bool
    routed_scaling_factor: float
    patch_size: int
    patch_embed_hidden_dim: int
    vae_downsample_factor: tuple[int, int]
    image_base_size: int
    vae: VaeConfig

    @classmethod
    def from_dict(cls, d: dict) -> HunyuanImage3Config:
        for key, want in (("hidden_act", "silu"), ("img_proj_type", "unet"),
                          ("use_mla", False), ("use_cla", False), ("moe_layer_num_skipped", 0),
                          ("group_limited_greedy", False), ("attention_bias", False),
                          ("mlp_bias", False)):
            if d.get(key, want) != want:
                raise NotImplementedError(f"config {key}={d.get(key)!r}: only {want!r} is supported")
        for key in ("num_experts", "moe_topk", "moe_intermediate_size", "num_shared_expert"):
            if isinstance(d.get(key), list):
                raise NotImplementedError(f"config {key} per layer: not supported")
        heads = d["num_attention_heads"]
        moe_inter = d.get("moe_intermediate_size") or d["intermediate_size"]
        shared = moe_inter * d.get("num_shared_expert", 1) if d.get("use_mixed_mlp_moe") else 0
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("attention_head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5), rope_theta=d.get("rope_theta", 10000.0),
            use_qk_norm=bool(d.get("use_qk_norm", False)), num_experts=d["num_experts"],
            moe_topk=d["moe_topk"], moe_intermediate_size=moe_inter,
            shared_intermediate_size=shared, norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            patch_size=d.get("patch_size", 1),
            patch_embed_hidden_dim=d.get("patch_embed_hidden_dim", 1024),
            vae_downsample_factor=tuple(d.get("vae_downsample_factor", (16, 16))),
            image_base_size=d.get("image_base_size", 1024), vae=VaeConfig.from_dict(d["vae"]))

    @classmethod
    def from_folder(cls, path: Path) -> HunyuanImage3Config:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))
