"""The Qwen-Image VAE: diffusers' `AutoencoderKLQwenImage`, which is Wan 2.1's causal 3-D VAE
fine-tuned, so it is our `AutoencoderKLWan` (same modules, names and numerics) read from
Qwen-Image's config keys: one `input_channels` for both ends, no Wan 2.2 options. The one
difference in behaviour is diffusers': its tiled decode is not clamped to [-1, 1].

A text-to-image pipeline uses it on one-frame videos (T = T' = 1).
"""

from __future__ import annotations

from omnistage.models.autoencoder_kl_wan import AutoencoderKLWan, AutoencoderKLWanConfig

# diffusers' AutoencoderKLQwenImage.__init__ arguments
QWEN_IMAGE_KEYS = frozenset({"base_dim", "z_dim", "dim_mult", "num_res_blocks", "attn_scales",
                             "temperal_downsample", "dropout", "input_channels",
                             "latents_mean", "latents_std"})


class AutoencoderKLQwenImage(AutoencoderKLWan):
    clamp_tiled = False

    @classmethod
    def config_from_dict(cls, raw: dict) -> AutoencoderKLWanConfig:
        unknown = sorted(set(raw) - QWEN_IMAGE_KEYS)
        if unknown:
            raise ValueError(f"AutoencoderKLQwenImage config: unknown keys {unknown}")
        wan = {k: v for k, v in raw.items() if k != "input_channels"}
        channels = raw.get("input_channels", 3)
        # the scale factors are Wan-only keys: nothing stated, nothing to check
        return AutoencoderKLWanConfig.from_dict({**wan, "in_channels": channels,
                                                 "out_channels": channels,
                                                 "scale_factor_temporal": None,
                                                 "scale_factor_spatial": None})
