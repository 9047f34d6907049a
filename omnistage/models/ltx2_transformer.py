"""LTX-2 transformer: diffusers' `LTX2VideoTransformer3DModel` (LTX-2.0) in plain PyTorch, one
DiT over video and audio tokens at once.

Module and parameter names follow diffusers, so a diffusers `transformer/` folder loads by name
(`LTX2VideoTransformer3DModel.from_pretrained`); numerics follow
`diffusers/models/transformers/transformer_ltx2.py` op for op.

    video (B, N, C) packed latents -> proj_in -> x (B, N, D)      N = F' H' W' (patch 1)
    audio (B, M, Ca) packed latents -> audio_proj_in -> a (B, M, Da)
    text (B, L, caption) -> caption_projection (D), audio_caption_projection (Da)
    timestep (B,) or (B, N) -> time_embed (6D + emb), audio_time_embed (6Da + emb),
        av_cross_attn_*: the cross-modal scale/shift (4D, 4Da) and gates (D, Da)
    rope: video tokens at their patch's pixel-space midpoint (frames in seconds at fps),
          audio tokens at their latent frame's time; a2v / v2a attention with time only
    num_layers x LTX2VideoTransformerBlock:
        x += gate * attn1(rms(x) * (1 + scale) + shift)            video self (rope)
        a += gate * audio_attn1(...)                               audio self (rope)
        x += attn2(rms(x), text);  a += audio_attn2(rms(a), audio text)     masked
        x += gate * audio_to_video_attn(rms(x) mod, rms(a) mod)    Q video, K/V audio
        a += gate * video_to_audio_attn(rms(a) mod, rms(x) mod)    Q audio, K/V video
        x += gate * ff(rms(x) * (1 + scale) + shift);  a likewise
    norm_out (LayerNorm, shift/scale from scale_shift_table + emb) -> proj_out (B, N, C);
    audio the same -> (B, M, Ca)

Supported configs: LTX-2.0's (prompt embeddings projected here, no prompt AdaLN); the
per-head attention gates and "split" rope of later checkpoints too. LTX-2.3's prompt
modulation (`cross_attn_mod`), keyframe embeddings and bias-free FFNs are refused at load.
One rank: no tensor or sequence parallelism inside (the pipeline may split CFG branches).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omnistage.layers.dit import TimestepEmbedding
from omnistage.layers.step_cache import CacheGroup, run_cached
from omnistage.models.diffusers_loader import build_from_folder, config_from_dict, read_config
from omnistage.models.ltx2_transformer_layers import (BlockInputs, LTX2AdaLayerNormSingle,
                                                      LTX2VideoTransformerBlock, Rope,
                                                      audio_coords, rope_table, video_coords)

IDENTITY = (1.0, 0.0)       # the step cache's polynomial: none is published for LTX-2


@dataclass(frozen=True, slots=True)
class LTX2TransformerConfig:
    """diffusers' config.json of an LTX-2 `transformer/` folder (every key it writes)."""

    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 128
    cross_attention_dim: int = 4096
    vae_scale_factors: tuple[int, int, int] = (8, 32, 32)
    pos_embed_max_pos: int = 20
    base_height: int = 2048
    base_width: int = 2048
    gated_attn: bool = False
    cross_attn_mod: bool = False
    audio_in_channels: int = 128
    audio_out_channels: int | None = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_attention_heads: int = 32
    audio_attention_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_gated_attn: bool = False
    audio_cross_attn_mod: bool = False
    num_layers: int = 48
    activation_fn: str = "gelu-approximate"
    qk_norm: str = "rms_norm_across_heads"
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    caption_channels: int = 3840
    attention_bias: bool = True
    attention_out_bias: bool = True
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: int = 1000
    cross_attn_timestep_scale_multiplier: int = 1000
    rope_type: str = "interleaved"
    use_prompt_embeddings: bool = True
    perturbed_attn: bool = False          # STG may skip self-attentions (forward's stg_blocks)
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_prompt_adaln_single: bool = True
    use_keyframes_abs_pos_embedding: bool = False

    def __post_init__(self) -> None:
        unsupported = {"cross_attn_mod": self.cross_attn_mod,
                       "audio_cross_attn_mod": self.audio_cross_attn_mod,
                       "use_prompt_embeddings": not self.use_prompt_embeddings,
                       "ff_bias": not self.ff_bias, "audio_ff_bias": not self.audio_ff_bias,
                       "use_keyframes_abs_pos_embedding": self.use_keyframes_abs_pos_embedding,
                       "norm_elementwise_affine": self.norm_elementwise_affine,
                       "attention_bias": not self.attention_bias,
                       "attention_out_bias": not self.attention_out_bias,
                       "patch_size": self.patch_size != 1,
                       "patch_size_t": self.patch_size_t != 1,
                       "audio_patch_size": self.audio_patch_size != 1,
                       "audio_patch_size_t": self.audio_patch_size_t != 1}
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"LTX-2 transformer config: {bad} not supported (LTX-2.0's layout "
                             "is: no prompt modulation, prompt embeddings, biases, patch 1)")
        if self.rope_type not in ("interleaved", "split"):
            raise ValueError(f"rope_type {self.rope_type!r}: 'interleaved' or 'split'")
        if self.qk_norm != "rms_norm_across_heads":
            raise ValueError(f"qk_norm {self.qk_norm!r}: only 'rms_norm_across_heads'")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def audio_inner_dim(self) -> int:
        return self.audio_num_attention_heads * self.audio_attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> LTX2TransformerConfig:
        return config_from_dict(cls, raw, "LTX-2 transformer")


@dataclass(frozen=True, slots=True)
class Positions:
    """Where the tokens of one forward sit: the latent video grid (F', H', W') at `fps`, and
    the number of latent audio frames; every row of the batch alike."""
    grid: tuple[int, int, int]
    fps: float
    audio_frames: int


class LTX2VideoTransformer3DModel(nn.Module):
    def __init__(self, cfg: LTX2TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim, adim = cfg.inner_dim, cfg.audio_inner_dim
        self.proj_in = nn.Linear(cfg.in_channels, dim)
        self.audio_proj_in = nn.Linear(cfg.audio_in_channels, adim)
        self.caption_projection = TimestepEmbedding(cfg.caption_channels, dim, gelu_tanh=True)
        self.audio_caption_projection = TimestepEmbedding(cfg.caption_channels, adim,
                                                          gelu_tanh=True)
        self.time_embed = LTX2AdaLayerNormSingle(dim, 6)
        self.audio_time_embed = LTX2AdaLayerNormSingle(adim, 6)
        self.av_cross_attn_video_scale_shift = LTX2AdaLayerNormSingle(dim, 4)
        self.av_cross_attn_audio_scale_shift = LTX2AdaLayerNormSingle(adim, 4)
        self.av_cross_attn_video_a2v_gate = LTX2AdaLayerNormSingle(dim, 1)
        self.av_cross_attn_audio_v2a_gate = LTX2AdaLayerNormSingle(adim, 1)
        self.scale_shift_table = nn.Parameter(torch.empty(2, dim))
        self.audio_scale_shift_table = nn.Parameter(torch.empty(2, adim))
        self.transformer_blocks = nn.ModuleList([
            LTX2VideoTransformerBlock(
                dim, cfg.num_attention_heads, cfg.attention_head_dim, cfg.cross_attention_dim,
                adim, cfg.audio_num_attention_heads, cfg.audio_attention_head_dim,
                cfg.audio_cross_attention_dim, cfg.norm_eps, cfg.activation_fn, cfg.gated_attn,
                cfg.audio_gated_attn)
            for _ in range(cfg.num_layers)])
        self.norm_out = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, cfg.out_channels or cfg.in_channels)
        self.audio_norm_out = nn.LayerNorm(adim, eps=1e-6, elementwise_affine=False)
        self.audio_proj_out = nn.Linear(adim, cfg.audio_out_channels or cfg.audio_in_channels)

    def forward(self, hidden_states: Tensor, audio_hidden_states: Tensor,
                encoder_hidden_states: Tensor, audio_encoder_hidden_states: Tensor,
                timestep: Tensor, positions: Positions, audio_timestep: Tensor | None = None,
                encoder_attention_mask: Tensor | None = None, use_cross_timestep: bool = False,
                isolate_modalities: bool = False, sigma: Tensor | None = None,
                step_cache: list[CacheGroup] | None = None, stg_blocks: tuple[int, ...] = ()
                ) -> tuple[Tensor, Tensor]:
        """hidden_states (B, N, C) packed video latents, audio_hidden_states (B, M, Ca);
        text (B, L, caption_channels) each; timestep (B,) or (B, N) already scaled by
        timestep_scale_multiplier, audio_timestep (B,) (None: timestep); mask (B, L) 1 keep,
        0 drop. use_cross_timestep: the cross-modal modulation of both streams at the row's
        sigma (B,) (None: timestep), as diffusers' pipelines pass it (image-to-video: the
        video's timestep per token, its sigma per row). isolate: no audio-video attention
        (modality guidance). step_cache: per request and branch, skip the blocks on steps
        whose first modulated input (video and audio together) barely moved
        (layers/step_cache.py, no published polynomial: its change as is); None runs every
        block. stg_blocks: STG's perturbed pass, the self-attentions of these blocks skipped
        (a config with perturbed_attn only, as diffusers). -> video (B, N, C'), audio
        (B, M, Ca')."""
        cfg, b = self.cfg, hidden_states.shape[0]
        dtype = hidden_states.dtype
        audio_timestep = timestep if audio_timestep is None else audio_timestep
        t = timestep.reshape(b, -1)                                          # (B, 1 or N)
        at = audio_timestep.reshape(b, -1)
        temb, emb = self.time_embed(t, dtype)
        atemb, aemb = self.audio_time_embed(at, dtype)
        sigma = timestep if sigma is None else sigma
        video_ca_t = sigma.reshape(b, -1) if use_cross_timestep else t
        audio_ca_t = sigma.reshape(b, -1) if use_cross_timestep else at
        gate_factor = cfg.cross_attn_timestep_scale_multiplier / cfg.timestep_scale_multiplier
        mask = None if encoder_attention_mask is None else \
            (1 - encoder_attention_mask.to(dtype)) * -10000.0
        x = self.proj_in(hidden_states)
        a = self.audio_proj_in(audio_hidden_states)
        ropes = self.ropes(positions, x.device)
        inputs = BlockInputs(
            text=self.caption_projection(encoder_hidden_states),
            audio_text=self.audio_caption_projection(audio_encoder_hidden_states), mask=mask,
            temb=temb, audio_temb=atemb,
            ca=self.av_cross_attn_video_scale_shift(video_ca_t, dtype)[0],
            audio_ca=self.av_cross_attn_audio_scale_shift(audio_ca_t, dtype)[0],
            ca_gate=self.av_cross_attn_video_a2v_gate(video_ca_t * gate_factor, dtype)[0],
            audio_ca_gate=self.av_cross_attn_audio_v2a_gate(audio_ca_t * gate_factor, dtype)[0],
            rope=ropes[0], audio_rope=ropes[1], ca_rope=ropes[2], audio_ca_rope=ropes[3],
            isolate=isolate_modalities)
        perturbed = frozenset(stg_blocks) if cfg.perturbed_attn else frozenset()
        x, a = self._blocks(x, a, inputs, step_cache, perturbed)
        return (self._out(x, emb, self.scale_shift_table, self.norm_out, self.proj_out),
                self._out(a, aemb, self.audio_scale_shift_table, self.audio_norm_out,
                          self.audio_proj_out))

    def _blocks(self, x: Tensor, a: Tensor, inputs: BlockInputs,
                step_cache: list[CacheGroup] | None, perturbed: frozenset[int] = frozenset()
                ) -> tuple[Tensor, Tensor]:
        """Every block over both streams; with a step cache, both streams of a row flattened
        into one (B, 1, N D + M Da) so the cache treats them as one state."""
        def run(idx: Tensor | None) -> tuple[Tensor, Tensor]:
            h, g, c = (x, a, inputs) if idx is None else (x[idx], a[idx], inputs.rows(idx))
            for i, block in enumerate(self.transformer_blocks):
                h, g = block(h, g, c, i in perturbed)
            return h, g

        if step_cache is None:
            return run(None)
        size = x[0].numel()

        def join(v: Tensor, w: Tensor) -> Tensor:
            return torch.cat([v.flatten(1), w.flatten(1)], dim=1)[:, None]

        modulated = join(*self.transformer_blocks[0].modulated_inputs(x, a, inputs))
        out = run_cached(join(x, a), modulated, step_cache, IDENTITY,
                         lambda idx: join(*run(idx)))[:, 0]
        return out[:, :size].view_as(x), out[:, size:].view_as(a)

    @staticmethod
    def _out(x: Tensor, emb: Tensor, table: Tensor, norm: nn.LayerNorm, proj: nn.Linear
             ) -> Tensor:
        """norm_out(x) * (1 + scale) + shift, scale and shift = table + emb (B, S, D)."""
        shift, scale = (table + emb[:, :, None]).unbind(2)
        return proj(F.layer_norm(x, x.shape[-1:], eps=norm.eps) * (1 + scale) + shift)

    def ropes(self, pos: Positions, device: torch.device) -> tuple[Rope, Rope, Rope, Rope]:
        """The rope tables of video self-attention, audio self-attention, and the time-only
        ones of the a2v / v2a attention (video, audio)."""
        cfg = self.cfg
        v = video_coords(pos.grid, (cfg.patch_size_t, cfg.patch_size), cfg.vae_scale_factors,
                         cfg.causal_offset, pos.fps, device)
        a = audio_coords(pos.audio_frames, cfg.audio_patch_size_t, cfg.audio_scale_factor,
                         cfg.causal_offset, cfg.audio_sampling_rate, cfg.audio_hop_length,
                         device)
        base = (cfg.pos_embed_max_pos, cfg.base_height, cfg.base_width)
        cross_max = (max(cfg.pos_embed_max_pos, cfg.audio_pos_embed_max_pos),)
        args = (cfg.rope_theta, cfg.rope_double_precision, cfg.rope_type)
        return (rope_table(v, base, cfg.inner_dim, *args, cfg.num_attention_heads),
                rope_table(a, (cfg.audio_pos_embed_max_pos,), cfg.audio_inner_dim, *args,
                           cfg.audio_num_attention_heads),
                rope_table(v[0:1], cross_max, cfg.audio_cross_attention_dim, *args,
                           cfg.num_attention_heads),
                rope_table(a, cross_max, cfg.audio_cross_attention_dim, *args,
                           cfg.audio_num_attention_heads))

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> LTX2VideoTransformer3DModel:
        """Build from a diffusers folder (config.json + safetensors, maybe sharded) in `dtype`
        (None: the checkpoint's). Missing, unexpected or mis-shaped tensors raise ValueError."""
        path = Path(path)
        return build_from_folder(cls, LTX2TransformerConfig.from_dict(read_config(path)), path,
                                 device, dtype)
