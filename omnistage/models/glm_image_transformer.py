"""GLM-Image's DiT decoder: diffusers' `GlmImageTransformer2DModel` in plain PyTorch.

Module and parameter names follow diffusers, so a pipeline's `transformer/` folder loads by
name; numerics follow `diffusers/models/transformers/transformer_glm_image.py` op for op.

    latents (B,C,h,w) -> image_projector: p x p patches, one linear -> img (B,N,D)
    prior tokens (B,N) -> prior_token_embedding (zeroed where dropped) -> prior_projector
                          (SiLU MLP), added to img: the AR stage's visual tokens, upsampled
                          to the patch grid, are what the DiT decodes
    glyph text (B,T,text_embed_dim) -> glyph_projector (GELU MLP) -> txt (B,T,D)
    t, target size, crop -> time_condition_embed -> temb (B,E), already through SiLU
    num_layers x GlmImageTransformerBlock: one attention over [txt, img] (2-D rope on img,
        LayerNorm q/k), one MLP shared by both streams, 12-way AdaLN from temb
    norm_out (no SiLU before its linear) -> proj_out -> unpatchify -> (B,C,h,w)

An edit's condition images: `condition_kv` runs each once (its latents under its own prior
tokens, no text, timestep 0) and keeps every block's image keys and values; the denoising
rows of that edit attend to them before their own keys (`image_kv`), as diffusers'
GlmImageKVCache "write" then "read"; rows without them (CFG's unconditional rows: "skip",
other requests) mask them out.

D = num_attention_heads * attention_head_dim, E = time_embed_dim. Rows of a batch may carry
glyph texts of different lengths: `text_mask` hides each row's padding from the attention
(diffusers runs one text length per call, unmasked). One rank: no tensor or sequence
parallelism here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.dit import (AdaLayerNormContinuous, FeedForward, TimestepEmbedding,
                                  timestep_embedding)
from omnistage.layers.rotary import rotate_half
from omnistage.layers.sequence_parallel import sdpa
from omnistage.models.diffusers_loader import build_from_folder, config_from_dict, read_config

EPS = 1e-5


@dataclass(frozen=True, slots=True)
class GlmImageTransformerConfig:
    patch_size: int = 2
    in_channels: int = 16
    out_channels: int = 16
    num_layers: int = 30
    attention_head_dim: int = 40
    num_attention_heads: int = 64
    text_embed_dim: int = 1472
    time_embed_dim: int = 512
    condition_dim: int = 256
    prior_vq_quantizer_codebook_size: int = 16384

    def __post_init__(self) -> None:
        if self.attention_head_dim % 4:
            raise ValueError(f"attention_head_dim {self.attention_head_dim}: the 2-D rope "
                             f"needs a multiple of 4")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> GlmImageTransformerConfig:
        return config_from_dict(cls, raw, "GLM-Image transformer")


def glm_image_rope(head_dim: int, grid_h: int, grid_w: int, device: torch.device,
                   theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """cos, sin (N, hd) of the patch grid in row-major order: the first quarter of the
    frequencies turns with the row, the second with the column, both halves repeated (the
    rotate-half layout)."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, device=device)[: half // 2].float()
                               / half)                                       # (hd/4,)
    rows = torch.outer(torch.arange(grid_h, device=device).float(), inv_freq)
    cols = torch.outer(torch.arange(grid_w, device=device).float(), inv_freq)
    freqs = torch.cat([rows[:, None].expand(-1, grid_w, -1),
                       cols[None].expand(grid_h, -1, -1)], dim=-1)            # (h, w, hd/2)
    freqs = torch.cat([freqs, freqs], dim=-1).reshape(grid_h * grid_w, -1)   # (N, hd)
    return freqs.cos(), freqs.sin()


def _rotate(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    cos, sin = (t[None, :, None] for t in rope)                              # (1, N, 1, hd)
    return (x.float() * cos + rotate_half(x).float() * sin).to(x.dtype)


# ---- embeddings ----------------------------------------------------------------------------

class GlmImageCombinedTimestepSizeEmbeddings(nn.Module):
    """temb = SiLU(mlp(sin(t)) + mlp(sin(crop), sin(target size)))."""

    def __init__(self, dim: int, condition_dim: int) -> None:
        super().__init__()
        self.dim, self.condition_dim = dim, condition_dim
        self.timestep_embedder = TimestepEmbedding(dim, dim)
        self.condition_embedder = TimestepEmbedding(4 * condition_dim, dim)

    def forward(self, timestep: Tensor, target_size: Tensor, crop_coords: Tensor,
                dtype: torch.dtype) -> Tensor:
        b = timestep.shape[0]
        sizes = [timestep_embedding(c.flatten(), self.condition_dim).view(b, -1)
                 for c in (crop_coords, target_size)]                        # (B, 2*cond) each
        temb = self.timestep_embedder(timestep_embedding(timestep, self.dim).to(dtype))
        return F.silu(temb + self.condition_embedder(torch.cat(sizes, dim=1).to(dtype)))


class GlmImageImageProjector(nn.Module):
    def __init__(self, in_channels: int, dim: int, patch_size: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Linear(in_channels * patch_size ** 2, dim)

    def forward(self, latents: Tensor) -> Tensor:
        b, c, h, w = latents.shape
        p = self.patch_size
        x = latents.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return self.proj(x.reshape(b, (h // p) * (w // p), c * p * p))        # (B, N, D)


class GlmImageAdaLayerNormZero(nn.Module):
    """Both streams' modulation from one linear over temb (no SiLU: temb has had it), in
    diffusers' interleaved order (image chunk, then text chunk, for each of six roles)."""

    def __init__(self, cond_dim: int, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(cond_dim, 12 * dim)

    def forward(self, img: Tensor, txt: Tensor, temb: Tensor
                ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
        """-> modulated img, modulated txt, img's (gate_msa, shift, scale, gate_mlp),
        txt's the same."""
        chunks = self.linear(temb).chunk(12, dim=1)                          # (B, D) each
        shift, scale, gate_msa, shift_mlp, scale_mlp, gate_mlp = chunks[0::2]
        c_shift, c_scale, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = chunks[1::2]
        img = F.layer_norm(img, img.shape[-1:], eps=EPS) * (1 + scale[:, None]) + shift[:, None]
        txt = F.layer_norm(txt, txt.shape[-1:], eps=EPS) * (1 + c_scale[:, None]) + c_shift[:, None]
        return (img, txt, [gate_msa, shift_mlp, scale_mlp, gate_mlp],
                [c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp])


# ---- attention and block -------------------------------------------------------------------

class GlmImageAttention(nn.Module):
    """Joint attention over [txt, img] with shared projections; per-head LayerNorm (no
    affine) on q and k, the 2-D rope on the image part only."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        inner = num_heads * head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])

    def _heads(self, x: Tensor, norm: bool) -> Tensor:
        x = x.unflatten(-1, (-1, self.head_dim))                             # (B, S, H, hd)
        return F.layer_norm(x, x.shape[-1:], eps=EPS) if norm else x

    def forward(self, txt: Tensor, img: Tensor, rope: tuple[Tensor, Tensor],
                key_mask: Tensor | None, image_kv: Tensor | None = None,
                kv_out: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """image_kv (2, B, M, H, hd): condition images' keys and values, attended to before
        the row's own (key_mask covers them first); kv_out: this layer's image keys and
        values (2, B, N, H, hd) appended to it (the condition pass)."""
        num_txt = txt.shape[1]
        x = torch.cat([txt, img], dim=1)                                     # (B, T+N, D)
        q, k = self._heads(self.to_q(x), True), self._heads(self.to_k(x), True)
        v = self._heads(self.to_v(x), False)
        q = torch.cat([q[:, :num_txt], _rotate(q[:, num_txt:], rope)], dim=1)
        k = torch.cat([k[:, :num_txt], _rotate(k[:, num_txt:], rope)], dim=1)
        if kv_out is not None:
            kv_out.append(torch.stack([k[:, num_txt:], v[:, num_txt:]]))
        if image_kv is not None:
            k, v = torch.cat([image_kv[0], k], dim=1), torch.cat([image_kv[1], v], dim=1)
        out = self.to_out[0](sdpa(q, k, v, key_mask).flatten(2).to(q.dtype))  # (B, T+N, D)
        return out[:, :num_txt], out[:, num_txt:]


def _modulated(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=EPS) * (1 + scale[:, None]) + shift[:, None]


class GlmImageTransformerBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, time_embed_dim: int) -> None:
        super().__init__()
        self.norm1 = GlmImageAdaLayerNormZero(time_embed_dim, dim)
        self.attn1 = GlmImageAttention(dim, num_heads, head_dim)
        self.ff = FeedForward(dim)          # one MLP for both streams

    def forward(self, img: Tensor, txt: Tensor, temb: Tensor, rope: tuple[Tensor, Tensor],
                key_mask: Tensor | None, image_kv: Tensor | None = None,
                kv_out: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
        img_h, txt_h, (gate, shift_mlp, scale_mlp, gate_mlp), \
            (c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp) = self.norm1(img, txt, temb)
        txt_attn, img_attn = self.attn1(txt_h, img_h, rope, key_mask, image_kv, kv_out)
        img = img + img_attn * gate[:, None]
        txt = txt + txt_attn * c_gate[:, None]
        img = img + self.ff(_modulated(img, shift_mlp, scale_mlp)) * gate_mlp[:, None]
        txt = txt + self.ff(_modulated(txt, c_shift_mlp, c_scale_mlp)) * c_gate_mlp[:, None]
        return img, txt


# ---- model ---------------------------------------------------------------------------------

class GlmImageTransformer2DModel(nn.Module):
    # FP8 (layers/fp8.py): linears left in bf16, besides those too small: the embeddings and
    # projectors, the blocks' modulation, the output norm's and the final projection
    fp8_keep = ("time_condition_embed.*", "image_projector.*", "glyph_projector.*",
                "prior_projector.*", "*.norm1.*", "norm_out.*", "proj_out")

    def __init__(self, cfg: GlmImageTransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim, heads, head_dim = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
        self.image_projector = GlmImageImageProjector(cfg.in_channels, dim, cfg.patch_size)
        self.glyph_projector = FeedForward(cfg.text_embed_dim, inner_dim=dim, dim_out=dim,
                                           activation="gelu")
        self.prior_token_embedding = nn.Embedding(cfg.prior_vq_quantizer_codebook_size, dim)
        self.prior_projector = FeedForward(dim, inner_dim=dim, activation="linear-silu")
        self.time_condition_embed = GlmImageCombinedTimestepSizeEmbeddings(
            cfg.time_embed_dim, cfg.condition_dim)
        self.transformer_blocks = nn.ModuleList(
            [GlmImageTransformerBlock(dim, heads, head_dim, cfg.time_embed_dim)
             for _ in range(cfg.num_layers)])
        self.norm_out = AdaLayerNormContinuous(dim, cfg.time_embed_dim, silu=False, eps=EPS)
        self.proj_out = nn.Linear(dim, cfg.patch_size ** 2 * cfg.out_channels)

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor,
                prior_token_id: Tensor, prior_token_drop: Tensor, timestep: Tensor,
                target_size: Tensor, crop_coords: Tensor, text_mask: Tensor | None = None,
                image_kv: Tensor | None = None, image_kv_mask: Tensor | None = None,
                kv_out: list[Tensor] | None = None) -> Tensor:
        """hidden_states (B, C, h, w), encoder_hidden_states (B, T, text_embed_dim) glyph
        embeddings, prior_token_id (B, N) and prior_token_drop (B, N) bool (True: that row's
        prior is dropped, the unconditional branch), timestep (B,) as the pipeline's (t - 1),
        target_size and crop_coords (B, 2), text_mask (B, T) bool (True: a real text token;
        None: all are); an edit's image_kv (L, 2, B, M, H, hd), its condition images' keys
        and values per block (`condition_kv`), and image_kv_mask (B, M) (True: a real one;
        None: all are); kv_out: every block's image keys and values appended (the condition
        pass) -> (B, C_out, h, w)."""
        b, _, h, w = hidden_states.shape
        p = self.cfg.patch_size
        if h % p or w % p:
            raise ValueError(f"latent {h}x{w}: not a multiple of patch_size {p}")
        if prior_token_id.shape != (b, (h // p) * (w // p)):
            raise ValueError(f"prior_token_id {tuple(prior_token_id.shape)}: expected one per "
                             f"patch, ({b}, {(h // p) * (w // p)})")
        img = self.image_projector(hidden_states)                            # (B, N, D)
        prior = self.prior_token_embedding(prior_token_id)                    # (B, N, D)
        img = img + self.prior_projector(prior.masked_fill(prior_token_drop[..., None], 0.0))
        txt = self.glyph_projector(encoder_hidden_states)                    # (B, T, D)
        temb = self.time_condition_embed(timestep, target_size, crop_coords, img.dtype)
        rope = glm_image_rope(self.cfg.attention_head_dim, h // p, w // p, img.device)
        key_mask = _key_mask(text_mask, image_kv, image_kv_mask, txt.shape[1], img.shape[1])
        for i, block in enumerate(self.transformer_blocks):
            img, txt = block(img, txt, temb, rope, key_mask,
                             None if image_kv is None else image_kv[i], kv_out)
        out = self.proj_out(self.norm_out(img, temb))                        # (B, N, C*p*p)
        out = out.reshape(b, h // p, w // p, -1, p, p)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(b, -1, h, w)           # (B, C, h, w)

    def condition_kv(self, latents: Tensor, prior_token_id: Tensor, target_size: Tensor
                     ) -> Tensor:
        """One condition image's keys and values in every block, as diffusers' "write" pass
        fills its KV cache: the image's normalised VAE latents (1, C, h, w) under its prior
        tokens (1, N), no text, timestep 0, its own size (1, 2) -> (L, 2, N, H, hd)."""
        kv: list[Tensor] = []
        zeros = latents.new_zeros
        self(latents, zeros(1, 0, self.cfg.text_embed_dim), prior_token_id,
             torch.zeros_like(prior_token_id, dtype=torch.bool), zeros(1), target_size,
             zeros(1, 2), kv_out=kv)
        return torch.stack(kv)[:, :, 0]

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> GlmImageTransformer2DModel:
        """Build from a diffusers folder (config.json + safetensors, maybe sharded) in `dtype`
        (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        return build_from_folder(cls, GlmImageTransformerConfig.from_dict(read_config(path)),
                                 path, device, dtype)


def _key_mask(text_mask: Tensor | None, image_kv: Tensor | None, image_kv_mask: Tensor | None,
              num_txt: int, num_img: int) -> Tensor | None:
    """(B, M + T + N) keys a row attends to: its condition images' (where it has them), its
    real text tokens, every image token; None when that is all of them."""
    if text_mask is None and image_kv_mask is None:
        return None
    ref = text_mask if text_mask is not None else image_kv_mask
    parts = [] if image_kv is None else [
        image_kv_mask if image_kv_mask is not None
        else ref.new_ones(ref.shape[0], image_kv.shape[3])]
    parts += [text_mask if text_mask is not None else ref.new_ones(ref.shape[0], num_txt),
              ref.new_ones(ref.shape[0], num_img)]
    return torch.cat(parts, dim=1)
