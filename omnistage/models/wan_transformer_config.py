"""The Wan transformer's sizes (`WanTransformerConfig`, diffusers' config.json of a
`transformer/` folder) and TeaCache's published polynomials for the Wan2.1 shapes
(`teacache_coefficients`), which the model and the step-caching bench pick by config."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.models.diffusers_loader import config_from_dict

# Step caching (layers/step_cache.py). Where TeaCache publishes a polynomial for the model
# (ali-vilab/TeaCache, TeaCache4Wan2.1/teacache_generate.py, its variant without
# `use_ret_steps`: the first and the last step always computed, as our state machine does), the
# indicator is what it was fitted on: the relative L1 change of the timestep embedding (`e`
# there, `temb` here), per row. Wan2.1 I2V has one per resolution (480P and 720P checkpoints
# share a config): chosen by the latent grid's tokens per frame, 720P's above the midpoint.
# Other models (Wan2.2) watch the first block's modulated input, its change used as is.
TEACACHE_T2V = {1536: (2.39676752e+03, -1.31110545e+03, 2.01331979e+02, -8.29855975e+00,
                       1.37887774e-01),                                      # T2V 1.3B
                5120: (-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429,
                       -13.02252404)}                                        # T2V 14B
TEACACHE_I2V_480P = (-3.02331670e+02, 2.23948934e+02, -5.25463970e+01, 5.87348440e+00,
                     -2.01973289e-01)
TEACACHE_I2V_720P = (-114.36346466, 65.26524496, -18.82220707, 4.91518089, -0.23412683)
TOKENS_480P, TOKENS_720P = 30 * 52, 45 * 80          # per latent frame, 2x2 patches


@dataclass(frozen=True, slots=True)
class WanTransformerConfig:
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"   # diffusers builds the same norms for any
    eps: float = 1e-6
    image_dim: int | None = None                     # Wan2.1 I2V: CLIP vision width (1280)
    added_kv_proj_dim: int | None = None             # its image keys/values' input width
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None             # FLF2V: 2 x 257 image tokens

    def __post_init__(self) -> None:
        if len(self.patch_size) != 3:
            raise ValueError(f"patch_size must be (t, h, w), got {self.patch_size}")
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValueError(f"image_dim ({self.image_dim}) and added_kv_proj_dim "
                             f"({self.added_kv_proj_dim}) must be set together")
        if self.added_kv_proj_dim not in (None, self.inner_dim):   # it reads embedded tokens
            raise ValueError(f"added_kv_proj_dim ({self.added_kv_proj_dim}) must equal "
                             f"num_attention_heads * attention_head_dim ({self.inner_dim})")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict) -> WanTransformerConfig:
        return config_from_dict(cls, raw, "Wan transformer")


def teacache_coefficients(cfg: WanTransformerConfig, grid: tuple[int, int, int]
                          ) -> tuple[float, ...] | None:
    """TeaCache's polynomial for a Wan2.1 T2V / I2V config on an F' x H' x W' token grid;
    None for the others (module comment above)."""
    shape = (cfg.inner_dim, cfg.num_layers, cfg.in_channels)
    if cfg.image_dim is None and shape in ((1536, 30, 16), (5120, 40, 16)):
        return TEACACHE_T2V[cfg.inner_dim]
    if cfg.image_dim is not None and shape == (5120, 40, 36) and not cfg.pos_embed_seq_len:
        per_frame = grid[1] * grid[2]
        return TEACACHE_I2V_720P if 2 * per_frame > TOKENS_480P + TOKENS_720P \
            else TEACACHE_I2V_480P
    return None
