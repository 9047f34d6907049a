"""The original (non-diffusers) tensor layouts community GGUF files ship, mapped to diffusers'
names (which our models keep), as diffusers' single-file converters map them
(`convert_flux_transformer_checkpoint_to_diffusers`). One table per layout: each row is
an original tensor and the diffusers tensors it holds, stacked along rows (dim 0), which a
block-quantized tensor can split as well as a plain one (its blocks run along a row):

    double_blocks.0.img_attn.qkv.weight (3D, D)  ->  to_q (D, D) | to_k | to_v
    single_blocks.0.linear1.weight (3D + 4D, D)  ->  to_q | to_k | to_v | proj_mlp
    final_layer.adaLN_modulation.1 (2D, D)       ->  norm_out.linear, halves swapped
                                                     (BFL: shift, scale; diffusers: scale, shift)

FLUX.1 (BFL's names, city96's GGUF files) and Wan 2.1 / 2.2 (the Wan repository's names:
`blocks.0.self_attn.q`, renames only, applied in order as diffusers'
`convert_wan_transformer_to_diffusers` does) are mapped; a ComfyUI `model.diffusion_model.`
prefix is dropped. Qwen-Image files carry diffusers' names already.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

Tensors = dict[str, tuple[int, Tensor]]           # name -> (ggml type, tensor), gguf_loader's
SWAP = "swap"                                     # the row's halves exchanged


def _renames() -> list[tuple[str, str]]:
    pairs = [("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
             ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
             ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
             ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
             ("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"),
             ("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"),
             ("txt_in", "context_embedder"), ("img_in", "x_embedder"),
             ("final_layer.linear", "proj_out")]
    return pairs


def _double(i: int) -> list[tuple[str, list[str]]]:
    d, s = f"double_blocks.{i}.", f"transformer_blocks.{i}."
    rows = [(d + "img_mod.lin", [s + "norm1.linear"]),
            (d + "txt_mod.lin", [s + "norm1_context.linear"]),
            (d + "img_attn.qkv", [s + "attn.to_q", s + "attn.to_k", s + "attn.to_v"]),
            (d + "txt_attn.qkv", [s + "attn.add_q_proj", s + "attn.add_k_proj",
                                  s + "attn.add_v_proj"]),
            (d + "img_attn.proj", [s + "attn.to_out.0"]),
            (d + "txt_attn.proj", [s + "attn.to_add_out"]),
            (d + "img_mlp.0", [s + "ff.net.0.proj"]), (d + "img_mlp.2", [s + "ff.net.2"]),
            (d + "txt_mlp.0", [s + "ff_context.net.0.proj"]),
            (d + "txt_mlp.2", [s + "ff_context.net.2"])]
    norms = [(d + "img_attn.norm.query_norm.scale", s + "attn.norm_q.weight"),
             (d + "img_attn.norm.key_norm.scale", s + "attn.norm_k.weight"),
             (d + "txt_attn.norm.query_norm.scale", s + "attn.norm_added_q.weight"),
             (d + "txt_attn.norm.key_norm.scale", s + "attn.norm_added_k.weight")]
    return _with_bias(rows) + [(a, [b]) for a, b in norms]


def _single(i: int) -> list[tuple[str, list[str]]]:
    d, s = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
    rows = [(d + "modulation.lin", [s + "norm.linear"]),
            (d + "linear1", [s + "attn.to_q", s + "attn.to_k", s + "attn.to_v", s + "proj_mlp"]),
            (d + "linear2", [s + "proj_out"])]
    return _with_bias(rows) + [(d + "norm.query_norm.scale", [s + "attn.norm_q.weight"]),
                               (d + "norm.key_norm.scale", [s + "attn.norm_k.weight"])]


def _with_bias(rows: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    return [(a + f".{p}", [n + f".{p}" for n in b]) for a, b in rows for p in ("weight", "bias")]


def flux_table(names: set[str]) -> list[tuple[str, list[str] | str]]:
    """(BFL name, the diffusers names it stacks, or (SWAP, name)) for a FLUX.1 file's names."""
    count = {kind: 1 + max((int(m.group(1)) for n in names
                            if (m := re.match(rf"{kind}\.(\d+)\.", n))), default=-1)
             for kind in ("double_blocks", "single_blocks")}
    table: list = _with_bias([(a, [b]) for a, b in _renames()])
    table += [(f"final_layer.adaLN_modulation.1.{p}", (SWAP, f"norm_out.linear.{p}"))
              for p in ("weight", "bias")]
    for i in range(count["double_blocks"]):
        table += _double(i)
    for i in range(count["single_blocks"]):
        table += _single(i)
    return table


def is_bfl_flux(names: set[str]) -> bool:
    return "double_blocks.0.img_attn.qkv.weight" in names


def split_rows(tensors: Tensors, name: str, parts: list[str], sizes: list[int]) -> Tensors:
    """The original tensor `name` cut along rows into `parts` of `sizes` rows."""
    qtype, data = tensors[name]
    return {p: (qtype, t.contiguous()) for p, t in zip(parts, data.split(sizes), strict=True)}


def from_bfl_flux(tensors: Tensors, sizes: dict[str, int]) -> Tensors:
    """A FLUX.1 file's tensors under diffusers' names. `sizes`: the rows of each diffusers
    linear a stacked tensor holds (the model's own shapes); unknown names fail by name."""
    out, left = {}, dict(tensors)
    for original, target in flux_table(set(tensors)):
        if original not in left:
            continue                                  # no bias / no guidance: checked later
        if isinstance(target, tuple):                 # (SWAP, name)
            qtype, data = left.pop(original)
            shift, scale = data.chunk(2)
            out[target[1]] = (qtype, torch.cat([scale, shift]))
            continue
        out.update(split_rows(left, original, target, [sizes[t] for t in target]))
        left.pop(original)
    if left:
        raise ValueError(f"GGUF file (BFL FLUX.1 layout): tensors {sorted(left)[:5]} have no "
                         "diffusers name")
    return out


# Wan's original names -> diffusers', substring renames applied in this order (norm2 / norm3
# trade places through a placeholder: the original's norm3 is diffusers' norm2)
WAN_RENAMES = (
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("cross_attn", "attn2"), ("self_attn", "attn1"),
    (".o.", ".to_out.0."), (".q.", ".to_q."), (".k.", ".to_k."), (".v.", ".to_v."),
    (".k_img.", ".add_k_proj."), (".v_img.", ".add_v_proj."),
    (".norm_k_img.", ".norm_added_k."),
    ("head.modulation", "scale_shift_table"), ("head.head", "proj_out"),
    ("modulation", "scale_shift_table"),
    ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"),
    ("norm2", "norm__placeholder"), ("norm3", "norm2"), ("norm__placeholder", "norm3"),
    ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
    ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
    ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
    ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"))
PREFIX = "model.diffusion_model."


def is_wan(names: set[str]) -> bool:
    return "blocks.0.self_attn.q.weight" in names


def from_wan(tensors: Tensors) -> Tensors:
    """A Wan file's tensors under diffusers' names."""
    out = {}
    for name, value in tensors.items():
        for old, new in WAN_RENAMES:
            name = name.replace(old, new)
        out[name] = value
    return out


def to_diffusers_names(tensors: Tensors, sizes: dict[str, int]) -> Tensors:
    """The file's tensors under diffusers' names, whichever known layout it has (`sizes`:
    the model's rows per tensor, for the layouts that stack)."""
    if any(n.startswith(PREFIX) for n in tensors):
        tensors = {n.removeprefix(PREFIX): v for n, v in tensors.items()}
    if is_bfl_flux(set(tensors)):
        return from_bfl_flux(tensors, sizes)
    return from_wan(tensors) if is_wan(set(tensors)) else tensors
