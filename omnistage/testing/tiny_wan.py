"""A tiny random Wan2.1 text-to-video folder in diffusers' layout (UMT5, the transformer, the
causal video VAE, flow UniPC), saved by diffusers' own `WanPipeline`: what the Wan pipeline's
golden tests and the video server tests serve. 8x VAE, 2x2 patches: a size of 32x48 pixels
is 4x6 latents."""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                 num_train_timesteps=1000)


def build_tiny_wan(path: Path):
    """Save the folder to `path`; -> diffusers' pipeline (the reference), in float32."""
    import diffusers
    import transformers

    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer(path / "tokenizer")
    encoder = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=len(tokenizer), d_model=16, d_kv=4, d_ff=24, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=12,
        feed_forward_proj="gated-gelu")).eval()
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2).eval()
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4],
                                     num_res_blocks=1, temperal_downsample=[False, True, True],
                                     latents_mean=[0.1, -0.2, 0.3, -0.4],
                                     latents_std=[1.5, 0.7, 2.0, 1.1]).eval()
    with torch.no_grad():      # every weight drawn: no path starts at zero
        for name, p in [*transformer.named_parameters(), *encoder.named_parameters()]:
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.1)
    scheduler = diffusers.UniPCMultistepScheduler(**SCHEDULER)
    pipe = diffusers.WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=vae,
                                 transformer=transformer, scheduler=scheduler)
    pipe.save_pretrained(path)
    return pipe


def build_tiny_wan_i2v(path: Path):
    """A tiny Wan2.1 image-to-video folder: the text-to-video folder's tokenizer, UMT5, VAE and
    scheduler, a transformer with CLIP image tokens (image_dim) taking [latents | first-frame
    mask | condition] (4 + 4 + 4 channels), and a CLIP vision encoder over 32x32 crops in
    8x8 patches (17 tokens of 16); saved by diffusers' own `WanImageToVideoPipeline`
    (-> it, the reference, in float32)."""
    import diffusers
    import transformers

    t2v = build_tiny_wan(path)
    torch.manual_seed(1)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=12,
        out_channels=4, text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2, image_dim=16,
        added_kv_proj_dim=24).eval()
    image_encoder = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8, hidden_act="gelu")).eval()
    with torch.no_grad():
        for name, p in [*transformer.named_parameters(), *image_encoder.named_parameters()]:
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.1)
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                                crop_size={"height": 32, "width": 32})
    pipe = diffusers.WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae,
        scheduler=t2v.scheduler, image_processor=processor, image_encoder=image_encoder,
        transformer=transformer)
    pipe.save_pretrained(path)
    return pipe
