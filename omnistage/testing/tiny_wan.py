"""Tiny random Wan folders in diffusers' layout (UMT5, the transformer(s), the causal video
VAE, flow UniPC), each saved by diffusers' own `WanPipeline`: what the Wan pipelines' golden
tests and the video server tests serve.

    build_tiny_wan        Wan2.1 T2V: 8x VAE, 2x2 patches (32x48 pixels: 4x6 latents)
    build_tiny_wan22_a14b Wan2.2 T2V-A14B: two transformers (high-noise `transformer`,
                          low-noise `transformer_2`) split at `boundary_ratio`
    build_tiny_wan22_ti2v Wan2.2 TI2V-5B: the residual, patchified VAE (16x), 2x2 patches (a
                          multiple of 32 pixels), `expand_timesteps`
    build_tiny_wan_i2v    Wan2.1 I2V (`WanImageToVideoPipeline`): a transformer over
                          [latents | first-frame mask | condition] with CLIP image tokens
    build_tiny_wan22_i2v  Wan2.2 I2V-A14B (`WanImageToVideoPipeline`): two such experts
                          without image tokens, split at `boundary_ratio`; no image encoder
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                 num_train_timesteps=1000)
# with 4 steps at flow_shift 3 the timesteps are 999, 900, 750, 500: two on each side
BOUNDARY_RATIO = 0.875


def _text_encoder(path: Path):
    """(tokenizer saved to path/tokenizer, UMT5 with every weight drawn)."""
    import transformers

    tokenizer = build_tiny_tokenizer(path / "tokenizer")
    encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=len(tokenizer), d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=12,
        feed_forward_proj="gated-gelu")).eval()
    return tokenizer, encoder


def _transformer(channels: int = 4, in_channels: int | None = None, **image_tokens):
    """in_channels: image-to-video's 4 + 4 + 4 (latents, mask, condition); image_tokens:
    Wan2.1 I2V's image_dim and added_kv_proj_dim."""
    import diffusers

    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
        in_channels=in_channels or channels, out_channels=channels, text_dim=16, freq_dim=32,
        ffn_dim=40, num_layers=2, **image_tokens).eval()


def _draw(*modules: torch.nn.Module) -> None:
    """Every weight drawn (norm gains near 1): no path starts at zero."""
    with torch.no_grad():
        for module in modules:
            for name, p in module.named_parameters():
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.1)


def _wan21_vae():
    import diffusers

    return diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4],
                                      num_res_blocks=1, temperal_downsample=[False, True, True],
                                      latents_mean=[0.1, -0.2, 0.3, -0.4],
                                      latents_std=[1.5, 0.7, 2.0, 1.1]).eval()


def _save(path: Path, pipeline: str = "WanPipeline", **parts):
    """diffusers' `pipeline` of these parts (and its switches) saved to `path`."""
    import diffusers

    pipe = getattr(diffusers, pipeline)(
        scheduler=diffusers.UniPCMultistepScheduler(**SCHEDULER), **parts)
    pipe.save_pretrained(path)
    return pipe


def build_tiny_wan(path: Path):
    """Save the Wan2.1 folder to `path`; -> diffusers' pipeline (the reference), in float32."""
    torch.manual_seed(0)
    tokenizer, encoder = _text_encoder(path)
    transformer, vae = _transformer(), _wan21_vae()
    _draw(transformer, encoder)
    return _save(path, tokenizer=tokenizer, text_encoder=encoder, vae=vae,
                 transformer=transformer)


def build_tiny_wan22_a14b(path: Path):
    """Save the two-expert folder to `path` (model_index.json: boundary_ratio); -> diffusers'
    pipeline, in float32. The experts' weights differ, so the wrong one changes the result."""
    torch.manual_seed(1)
    tokenizer, encoder = _text_encoder(path)
    high, low, vae = _transformer(), _transformer(), _wan21_vae()
    _draw(high, low, encoder)
    return _save(path, tokenizer=tokenizer, text_encoder=encoder, vae=vae, transformer=high,
                 transformer_2=low, boundary_ratio=BOUNDARY_RATIO)


def build_tiny_wan22_ti2v(path: Path):
    """Save the TI2V folder to `path` (model_index.json: expand_timesteps); -> diffusers'
    `WanPipeline` in float32 (its components also make the image-to-video reference,
    `WanImageToVideoPipeline(..., expand_timesteps=True)`)."""
    import diffusers

    torch.manual_seed(2)
    tokenizer, encoder = _text_encoder(path)
    z = 6
    vae = diffusers.AutoencoderKLWan(
        base_dim=8, decoder_base_dim=12, z_dim=z, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
        out_channels=12, patch_size=2, scale_factor_spatial=16,
        latents_mean=[0.1, -0.2, 0.3, -0.4, 0.5, 0.0],
        latents_std=[1.5, 0.7, 2.0, 1.1, 0.9, 1.3]).eval()
    transformer = _transformer(z)
    _draw(transformer, encoder)
    with torch.no_grad():   # the VAE's RMS gains start at one: perturb them too
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.add_(torch.randn_like(p) * 0.2)
    return _save(path, tokenizer=tokenizer, text_encoder=encoder, vae=vae,
                 transformer=transformer, expand_timesteps=True)


def build_tiny_wan_i2v(path: Path):
    """Save the Wan2.1 I2V folder to `path`: a transformer with CLIP image tokens and a CLIP
    vision encoder over 32x32 crops in 8x8 patches (17 tokens of 16); -> diffusers'
    `WanImageToVideoPipeline` (the reference), in float32."""
    import transformers

    torch.manual_seed(3)
    tokenizer, encoder = _text_encoder(path)
    transformer = _transformer(in_channels=12, image_dim=16, added_kv_proj_dim=24)
    image_encoder = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8, hidden_act="gelu")).eval()
    _draw(transformer, encoder, image_encoder)
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                                crop_size={"height": 32, "width": 32})
    return _save(path, "WanImageToVideoPipeline", tokenizer=tokenizer, text_encoder=encoder,
                 vae=_wan21_vae(), transformer=transformer, image_encoder=image_encoder,
                 image_processor=processor)


def build_tiny_wan22_i2v(path: Path):
    """Save the Wan2.2 I2V-A14B folder to `path` (model_index.json: boundary_ratio, no image
    encoder); -> diffusers' `WanImageToVideoPipeline`, in float32. The experts' weights
    differ, so the wrong one changes the result."""
    torch.manual_seed(4)
    tokenizer, encoder = _text_encoder(path)
    high, low = _transformer(in_channels=12), _transformer(in_channels=12)
    _draw(high, low, encoder)
    return _save(path, "WanImageToVideoPipeline", tokenizer=tokenizer, text_encoder=encoder,
                 vae=_wan21_vae(), transformer=high, transformer_2=low,
                 boundary_ratio=BOUNDARY_RATIO)
