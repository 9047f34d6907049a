"""HunyuanVideo-1.5 transformers in the upstream repository's own layout
(`HunyuanVideo_1_5_DiffusionTransformer`: the `transformer/<version>/` folders of
tencent/HunyuanVideo-1.5, among them the super-resolution DiTs `720p_sr_distilled` and
`1080p_sr_distilled`, which no diffusers folder carries) loaded into our
`HunyuanVideo15Transformer3DModel` (diffusers' names): the config translated key by key, every
tensor renamed as it streams in.

    upstream                                      ours (diffusers)
    img_in.proj                                   x_embedder.proj
    time_in.mlp.{0,2} / time_r_in.mlp.{0,2}       time_embed.timestep_embedder(_r).linear_{1,2}
    txt_in.input_embedder                         context_embedder.proj_in
    txt_in.t_embedder.mlp.{0,2}                   context_embedder.time_text_embed.
                                                      timestep_embedder.linear_{1,2}
    txt_in.c_embedder.linear_{1,2}                context_embedder.time_text_embed.
                                                      text_embedder.linear_{1,2}
    txt_in.individual_token_refiner.blocks.i.     context_embedder.token_refiner.refiner_blocks.i.
        self_attn_qkv (fused q|k|v)                   attn.to_q, attn.to_k, attn.to_v
        self_attn_proj, mlp.fc1, mlp.fc2              attn.to_out.0, ff.net.0.proj, ff.net.2
        adaLN_modulation.1, norm1, norm2              norm_out.linear, norm1, norm2
    byt5_in.{layernorm, fc1, fc2, fc3}            context_embedder_2.{norm, linear_1, _2, _3}
    vision_in.proj.{0, 1, 3, 4}                   image_embedder.{norm_in, linear_1, _2, norm_out}
    cond_type_embedding                           cond_type_embed
    double_blocks.i.                              transformer_blocks.i.
        img_mod / txt_mod .linear                     norm1 / norm1_context .linear
        img_attn_{q,k,v}, img_attn_proj               attn.to_{q,k,v}, attn.to_out.0
        txt_attn_{q,k,v}, txt_attn_proj               attn.add_{q,k,v}_proj, attn.to_add_out
        img_attn_{q,k}_norm, txt_attn_{q,k}_norm      attn.norm_{q,k}, attn.norm_added_{q,k}
        img_mlp / txt_mlp .fc{1,2}                    ff / ff_context .net.0.proj, .net.2
    final_layer.adaLN_modulation.1 (shift|scale)  norm_out.linear (scale|shift: halves swapped)
    final_layer.linear                            proj_out

Only what our model builds is accepted: dual-stream blocks alone (no single-stream ones), the
token refiner, the byT5 glyph stream, the linear vision projection and the condition-type
embedding, no guidance embedding, no pooled text vector.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from omnistage.models.diffusers_loader import build_empty, iter_safetensors
from omnistage.models.hunyuan_video15_transformer import (HunyuanVideo15Transformer3DModel,
                                                          HunyuanVideo15TransformerConfig)
from omnistage.models.loader import check_tensor_names, checkpoint_names, load_packed_weights

# the upstream's resolution tiers (`SizeMap`, hunyuan_video_sr_pipeline.py): bucket side in px
RESOLUTIONS = {"360p": 480, "480p": 640, "720p": 960, "1080p": 1440}
# config keys that must hold these values for our model to be the same network
REQUIRED = {"mm_single_blocks_depth": 0, "text_projection": "single_refiner",
            "guidance_embed": False, "text_pool_type": None, "glyph_byT5_v2": True,
            "vision_projection": "linear", "use_cond_type_embedding": True,
            "qk_norm": True, "qk_norm_type": "rms", "qkv_bias": True,
            "mlp_act_type": "gelu_tanh", "use_attention_mask": True,
            "is_reshape_temporal_channels": False}
# keys that change how, not what, is computed (kernels, defaults of the other layout)
IGNORED = {"attn_param", "ideal_task", "text_states_dim_2"}

BLOCK = {"img_mod.linear": "norm1.linear", "txt_mod.linear": "norm1_context.linear",
         "img_attn_q": "attn.to_q", "img_attn_k": "attn.to_k", "img_attn_v": "attn.to_v",
         "img_attn_proj": "attn.to_out.0", "img_attn_q_norm": "attn.norm_q",
         "img_attn_k_norm": "attn.norm_k", "txt_attn_q": "attn.add_q_proj",
         "txt_attn_k": "attn.add_k_proj", "txt_attn_v": "attn.add_v_proj",
         "txt_attn_proj": "attn.to_add_out", "txt_attn_q_norm": "attn.norm_added_q",
         "txt_attn_k_norm": "attn.norm_added_k", "img_mlp.fc1": "ff.net.0.proj",
         "img_mlp.fc2": "ff.net.2", "txt_mlp.fc1": "ff_context.net.0.proj",
         "txt_mlp.fc2": "ff_context.net.2"}
REFINER = {"self_attn_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2",
           "adaLN_modulation.1": "norm_out.linear", "norm1": "norm1", "norm2": "norm2"}
TOP = {"img_in.proj": "x_embedder.proj", "cond_type_embedding": "cond_type_embed",
       "time_in.mlp.0": "time_embed.timestep_embedder.linear_1",
       "time_in.mlp.2": "time_embed.timestep_embedder.linear_2",
       "time_r_in.mlp.0": "time_embed.timestep_embedder_r.linear_1",
       "time_r_in.mlp.2": "time_embed.timestep_embedder_r.linear_2",
       "txt_in.input_embedder": "context_embedder.proj_in",
       "txt_in.t_embedder.mlp.0": "context_embedder.time_text_embed.timestep_embedder.linear_1",
       "txt_in.t_embedder.mlp.2": "context_embedder.time_text_embed.timestep_embedder.linear_2",
       "txt_in.c_embedder.linear_1": "context_embedder.time_text_embed.text_embedder.linear_1",
       "txt_in.c_embedder.linear_2": "context_embedder.time_text_embed.text_embedder.linear_2",
       "byt5_in.layernorm": "context_embedder_2.norm", "byt5_in.fc1": "context_embedder_2.linear_1",
       "byt5_in.fc2": "context_embedder_2.linear_2", "byt5_in.fc3": "context_embedder_2.linear_3",
       "vision_in.proj.0": "image_embedder.norm_in", "vision_in.proj.1": "image_embedder.linear_1",
       "vision_in.proj.3": "image_embedder.linear_2", "vision_in.proj.4": "image_embedder.norm_out",
       "final_layer.adaLN_modulation.1": "norm_out.linear", "final_layer.linear": "proj_out"}
_DOUBLE = re.compile(r"double_blocks\.(\d+)\.(.+)\.(weight|bias)$")
_REFINER = re.compile(r"txt_in\.individual_token_refiner\.blocks\.(\d+)\.(.+)\.(weight|bias)$")


def config_from_original(raw: dict, path: Path | str = "config.json"
                         ) -> HunyuanVideo15TransformerConfig:
    """Our config from the upstream transformer's config.json (`_` keys included or not)."""
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    wrong = {k: raw[k] for k, v in REQUIRED.items() if k in raw and raw[k] != v}
    if wrong:
        raise ValueError(f"{path}: {wrong}: not the network HunyuanVideo15Transformer3DModel "
                         f"builds (it needs {({k: REQUIRED[k] for k in wrong})})")
    if raw.get("attn_mode") == "flex-block-attn":
        raise ValueError(f"{path}: attn_mode 'flex-block-attn' (sparse SSTA attention) is not "
                         "built; the dense checkpoints load")
    patch = list(raw.get("patch_size", [1, 1, 1]))
    if len(patch) != 3 or patch[1] != patch[2]:
        raise ValueError(f"{path}: patch_size {patch}: (t, p, p) expected")
    resolution = raw.get("ideal_resolution") or "480p"
    if resolution not in RESOLUTIONS:
        raise ValueError(f"{path}: ideal_resolution {resolution!r} (one of {list(RESOLUTIONS)})")
    hidden, heads = raw.get("hidden_size", 3072), raw.get("heads_num", 24)
    known = set(REQUIRED) | IGNORED | {
        "patch_size", "in_channels", "out_channels", "hidden_size", "heads_num",
        "mlp_width_ratio", "mm_double_blocks_depth", "rope_dim_list", "rope_theta",
        "text_states_dim", "vision_states_dim", "use_meanflow", "ideal_resolution", "attn_mode",
        "concat_condition"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}")
    latent = raw.get("in_channels", 4)
    # concat_condition: the patch embedding takes [noisy z | condition z | mask] (2 z + 1)
    in_channels = 2 * latent + 1 if raw.get("concat_condition", True) else latent
    return HunyuanVideo15TransformerConfig(
        in_channels=in_channels, out_channels=raw.get("out_channels") or latent,
        num_attention_heads=heads, attention_head_dim=hidden // heads,
        num_layers=raw.get("mm_double_blocks_depth", 20),
        mlp_ratio=float(raw.get("mlp_width_ratio", 4.0)), patch_size=patch[1],
        patch_size_t=patch[0], text_embed_dim=raw.get("text_states_dim", 4096),
        image_embed_dim=raw.get("vision_states_dim", 1280),
        rope_theta=float(raw.get("rope_theta", 256)),
        rope_axes_dim=tuple(raw.get("rope_dim_list", (16, 56, 56))),
        target_size=RESOLUTIONS[resolution], task_type=raw.get("ideal_task") or "t2v",
        use_meanflow=bool(raw.get("use_meanflow", False)))


def rename(name: str, tensor: Tensor) -> Iterator[tuple[str, Tensor]]:
    """One upstream tensor -> our tensor(s) (module docstring); unknown names pass unchanged
    (the strict load then names them)."""
    if m := _DOUBLE.match(name):
        idx, module, kind = m.groups()
        yield f"transformer_blocks.{idx}.{BLOCK.get(module, module)}.{kind}", tensor
    elif m := _REFINER.match(name):
        idx, module, kind = m.groups()
        prefix = f"context_embedder.token_refiner.refiner_blocks.{idx}."
        if module == "self_attn_qkv":
            for part, t in zip("qkv", tensor.chunk(3, dim=0)):
                yield f"{prefix}attn.to_{part}.{kind}", t
        else:
            yield f"{prefix}{REFINER.get(module, module)}.{kind}", tensor
    else:
        module, _, kind = name.rpartition(".")
        if module == "final_layer.adaLN_modulation.1":
            shift, scale = tensor.chunk(2, dim=0)
            tensor = torch.cat([scale, shift])
        yield f"{TOP.get(module, module)}.{kind}", tensor


def load_original_transformer(path: str | Path, device: torch.device | str = "cpu",
                              dtype: torch.dtype | None = None
                              ) -> HunyuanVideo15Transformer3DModel:
    """An upstream `transformer/<version>/` folder (config.json + safetensors, maybe sharded)
    as our model in `dtype` (None: the checkpoint's). Missing, unexpected or mis-shaped tensors
    raise ValueError naming them (in our names)."""
    path = Path(path)
    cfg = config_from_original(json.loads((path / "config.json").read_text()),
                               path / "config.json")
    model = build_empty(HunyuanVideo15Transformer3DModel, cfg, path, device, dtype)
    seen: list[str] = []

    def renamed() -> Iterator[tuple[str, Tensor]]:
        for name, tensor in iter_safetensors(path):
            for ours, t in rename(name, tensor):
                seen.append(ours)
                yield ours, t

    with torch.no_grad():
        loaded = load_packed_weights(model, renamed(), {})
    expected = checkpoint_names(model, {})
    check_tensor_names(path, "HunyuanVideo_1_5_DiffusionTransformer", expected, set(seen))
    assert loaded == expected, f"parameters not loaded: {expected - loaded}"
    return model.eval().requires_grad_(False)
