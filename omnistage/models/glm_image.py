"""GLM-Image's AR model: transformers' `GlmImageForConditionalGeneration`, its text decoder and
the head over the visual vocabulary (the tokens the DiT decodes), for the AR engine.

    ids (T,) -> embed_tokens -> num_layers x GlmImageTextDecoderLayer -> norm -> lm_head
    layer:  h += post_self_attn_norm(attn(input_norm(h)))      GQA, bias on q/k/v
            h += post_mlp_norm(mlp(post_attention_norm(h)))     SiLU-gated MLP

Positions are (3, T) multimodal rotary positions (t, h, w), contiguous sections, rotating the
first half of each head only (`partial_rotary_factor`). The head's vocabulary is the visual
one (`vision_vocab_size`: codebook ids, then the image start / end tokens), smaller than the
embedding's. An edit's condition images enter the prompt as visual tokens too: the vision
tower and VQ codebook (glm_image_vision.py, `image_tokens`) turn each into its grid of ids,
which replace the processor's image placeholders; their positions are `prompt_positions`'.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor, nn
from transformers import AutoConfig, PretrainedConfig

from omnistage.layers import fused
from omnistage.layers.mrope import MRotaryEmbedding
from omnistage.layers.norm import RMSNorm
from omnistage.layers.parallel import ParallelLMHead, VocabParallelEmbedding, tp_group
from omnistage.models.causal_lm import CausalLM
from omnistage.models.config import ModelConfig, check_tensor_parallel
from omnistage.models.glm_image_vision import (GlmImageVisionConfig, GlmImageVisionModel,
                                               GlmImageVQVAE)
from omnistage.models.loader import build_and_load, checkpoint_names, load_packed_weights
from omnistage.models.qwen2 import Qwen2Attention, Qwen2MLP

TOKEN_FACTOR = 32                   # pixels per AR visual token side
MAX_CONDITION_IMAGES = 4            # an edit's; each adds its grid to the AR prompt and
                                    # its keys and values to every DiT step's attention
PACKED_MODULES = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                  "v_proj": ("qkv_proj", "v")}     # gate_up_proj is fused in the checkpoint


def target_grids(height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The AR's (target, preview) token grids for an image of height x width pixels, as
    transformers' GlmImageProcessor._get_target_shape builds them."""
    token_h, token_w = height // TOKEN_FACTOR, width // TOKEN_FACTOR
    ratio = token_h / token_w
    preview = (int(math.sqrt(ratio) * (TOKEN_FACTOR // 2)),
               int(math.sqrt(1 / ratio) * (TOKEN_FACTOR // 2)))
    return (token_h, token_w), preview


def grid_positions(start: int, h: int, w: int) -> Tensor:
    """(3, h*w) rotary positions of an h x w grid of image tokens that starts at position
    `start`: t = start, h = start + row, w = start + col (row-major). The text after it
    resumes at start + max(h, w)."""
    rows = torch.arange(h).repeat_interleave(w)                              # (h*w,)
    cols = torch.arange(w).repeat(h)
    return torch.stack([torch.full((h * w,), start), start + rows, start + cols])


def image_decode_positions(start: int, grids: list[tuple[int, int]]) -> Tensor:
    """(3, G) rotary positions of what GLM-Image generates from position `start` on (after a
    text-to-image prompt: its length): the (rows, cols) grids in the order it writes them
    (text-to-image: the preview, then the target; an edit: the target), then one end token;
    as transformers' `get_rope_index`."""
    parts = []
    for h, w in grids:
        parts.append(grid_positions(start, h, w))
        start += max(h, w)
    parts.append(torch.full((3, 1), start))
    return torch.cat(parts, dim=1)                                           # (3, G)


def prompt_positions(ids: list[int], grids: list[tuple[int, int]], start_id: int,
                     end_id: int) -> tuple[Tensor, int]:
    """(3, P) rotary positions of an edit's prompt, whose condition images sit between an
    image start and an image end token each (grids: theirs, in order), and the position the
    generated tokens start at; as transformers' `get_rope_index`. Text (the start and end
    tokens included) counts on by one per token; an image's tokens take `grid_positions`."""
    starts = [i + 1 for i, t in enumerate(ids) if t == start_id]
    ends = [i for i, t in enumerate(ids) if t == end_id]
    if len(ends) != len(grids) or any(e - s != h * w for s, e, (h, w)
                                      in zip(starts, ends, grids)):
        raise ValueError(f"prompt: {len(ends)} complete images for {len(grids)} condition "
                         f"image grids {grids}, or a grid's token count differs")
    parts, pos, prev = [], 0, 0
    for s, e, (h, w) in zip(starts, ends, grids):
        parts.append(torch.arange(pos, pos + s - prev).expand(3, -1))       # text, start token
        pos += s - prev
        parts.append(grid_positions(pos, h, w))
        pos, prev = pos + max(h, w), e
    parts.append(torch.arange(pos, pos + len(ids) - prev).expand(3, -1))   # end token, text
    return torch.cat(parts, dim=1), pos + len(ids) - prev


@dataclass(frozen=True, slots=True)
class GlmImageARConfig:
    model: ModelConfig
    vision_vocab_size: int
    mrope_section: tuple[int, int, int]
    vision: GlmImageVisionConfig

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig) -> GlmImageARConfig:
        """config.json's text_config, under the checkpoint's architecture; its vision_config
        and vq_config for the image tokenizer."""
        text = copy.copy(hf_config.text_config)
        text.architectures = list(hf_config.architectures or [])
        model = ModelConfig.from_hf(text)
        return cls(model, text.vision_vocab_size,
                   tuple(model.rope_parameters.get("mrope_section", (8, 12, 12))),
                   GlmImageVisionConfig.from_hf(hf_config))


class GlmImageTextDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: MRotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg, rotary_emb)
        self.mlp = Qwen2MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=eps)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, eps=eps)

    def forward(self, positions: Tensor, h: Tensor) -> Tensor:            # h: (T, hidden)
        h = h + self.post_self_attn_layernorm(self.self_attn(positions, self.input_layernorm(h)))
        return h + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h)))


class GlmImageTextModel(nn.Module):
    def __init__(self, cfg: GlmImageARConfig) -> None:
        super().__init__()
        mc = cfg.model
        self.num_layers = mc.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(mc.vocab_size, mc.hidden_size)
        rotary_emb = MRotaryEmbedding(mc.head_dim, mc.max_position_embeddings, mc.rope_parameters,
                                      cfg.mrope_section, interleaved=False)
        self.layers = nn.ModuleList(GlmImageTextDecoderLayer(mc, rotary_emb)
                                    for _ in range(mc.num_hidden_layers))
        self.norm = RMSNorm(mc.hidden_size, eps=mc.rms_norm_eps)

    def forward(self, h: Tensor, positions: Tensor, capture_layers: tuple[int, ...] = ()
                ) -> tuple[Tensor, dict[int, Tensor]]:
        """Hidden states numbered as HF's `output_hidden_states` (0: embeddings, i: layer i's
        output, num_layers: after the final norm)."""
        captured = {0: h} if 0 in capture_layers else {}
        for i, layer in enumerate(self.layers, start=1):
            h = layer(positions, h)
            if i in capture_layers and i < self.num_layers:
                captured[i] = h
        h = self.norm(h)
        if self.num_layers in capture_layers:
            captured[self.num_layers] = h
        return h, captured


class GlmImageModel(nn.Module):
    """The checkpoint's `model.`: the language model, and the image tokenizer (vision tower,
    VQ codebook) that only an edit's condition images pass through."""

    def __init__(self, cfg: GlmImageARConfig) -> None:
        super().__init__()
        self.language_model = GlmImageTextModel(cfg)
        self.visual = GlmImageVisionModel(cfg.vision)
        self.vqmodel = GlmImageVQVAE(cfg.vision)


class GlmImageForConditionalGeneration(CausalLM):
    packed_modules = PACKED_MODULES
    checkpoint_prefix = ""
    checkpoint_exclude = ("model.vqmodel.post_quant_conv.",)     # the VQ decoder's
    uses_mrope = True               # the runner passes (3, T) positions

    def __init__(self, config: GlmImageARConfig) -> None:
        super().__init__()
        mc = config.model
        check_tensor_parallel(mc, tp_group().world_size, intermediate_size=mc.intermediate_size)
        self.config = config
        self.model = GlmImageModel(config)
        self.lm_head = ParallelLMHead(config.vision_vocab_size, mc.hidden_size)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> GlmImageForConditionalGeneration:
        """Build from config.json's text_config and load `model.language_model.*` and
        `lm_head.*` strictly; dtype None: the checkpoint's."""
        path = Path(path)
        config = GlmImageARConfig.from_hf(AutoConfig.from_pretrained(path))
        return build_and_load(cls, config, config.model, path, device, dtype)

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.language_model.embed_tokens(input_ids)   # (T,) -> (T, hidden)

    def forward(self, input_ids: Tensor, positions: Tensor, inputs_embeds: Tensor | None = None,
                capture_layers: tuple[int, ...] = ()) -> tuple[Tensor, dict[int, Tensor]]:
        """input_ids (T,) (ignored where inputs_embeds is given); positions (3, T) or (T,)."""
        h = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        return self.model.language_model(h, positions, capture_layers)

    @torch.inference_mode()
    def image_tokens(self, pixels: Tensor, grids: list[tuple[int, int]]) -> list[Tensor]:
        """Condition images -> their visual tokens: the processor's patch rows of every image
        (sum of h*w, C*p*p), row-major each, and their (h, w) grids -> per image its codebook
        ids (h*w,), on the CPU."""
        weight = self.model.visual.patch_embed.proj.weight
        rows = pixels.to(weight.device, weight.dtype).split([h * w for h, w in grids])
        return [self.model.vqmodel(self.model.visual(x, h, w), h, w).cpu()
                for x, (h, w) in zip(rows, grids)]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return fused.lm_head(self.lm_head, hidden).float()   # (N, hidden) -> (N, vision vocab)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return load_packed_weights(self, weights, self.packed_modules)

    def checkpoint_names(self) -> set[str]:
        return checkpoint_names(self, self.packed_modules)
