"""Tiny random LTX-2 decoders built with diffusers' own classes and saved with
`save_pretrained` (the Hub layout): the video VAE, the audio VAE and the vocoder. Parameters a
fresh model holds at zero or one (noise scales, modulation tables, latent statistics, snake
alphas) are perturbed so that their layout matters, and the vocoders' weights scaled
(VOCODER_GAIN) so that their waveform is audible-size on log-mel-like input (mean |x| 0.2-0.6,
the tests assert > 0.1), not 1e-2."""

from __future__ import annotations

from pathlib import Path

import torch

VIDEO_COMMON = dict(
    in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(16, 32),
    down_block_types=("LTX2VideoDownBlock3D",) * 2, layers_per_block=(1, 1, 1),
    spatio_temporal_scaling=(True, True), downsample_type=("spatiotemporal", "spatiotemporal"),
    decoder_block_out_channels=(16, 32), decoder_layers_per_block=(1, 1, 1),
    decoder_spatio_temporal_scaling=(True, True),
    upsample_type=("spatiotemporal", "spatiotemporal"), upsample_residual=(True, True),
    upsample_factor=(2, 2), patch_size=2, patch_size_t=1)
VIDEO_CONFIGS = {
    # LTX-2's shape: causal decoder, reflect padding, no timestep
    "ltx2": dict(VIDEO_COMMON, decoder_inject_noise=(False, False, False),
                 block_out_channels=(16, 32, 32), down_block_types=("LTX2VideoDownBlock3D",) * 3,
                 layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True, True, True),
                 downsample_type=("spatial", "temporal", "spatiotemporal"),
                 spatial_compression_ratio=8, temporal_compression_ratio=4, scaling_factor=0.7),
    # timestep-conditioned, noise-injecting, non-causal decoder, zero padding
    "timestep": dict(VIDEO_COMMON, decoder_inject_noise=(True, False, True),
                     timestep_conditioning=True, decoder_causal=False,
                     downsample_type=("spatiotemporal", "spatial"),
                     upsample_type=("spatiotemporal", "spatial"), spatial_compression_ratio=8,
                     temporal_compression_ratio=2, decoder_spatial_padding_mode="zeros"),
}
VIDEO_RATIOS = {"ltx2": (8, 4), "timestep": (8, 2)}      # (spatial, temporal)

AUDIO_CONFIGS = {
    # LTX-2's audio VAE shape: pixel norm, causal along time ("height"), stereo mel
    "ltx2": dict(base_channels=16, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=1,
                 in_channels=2, latent_channels=4, norm_type="pixel", causality_axis="height",
                 mel_bins=16, resolution=32),
    # attention blocks and group norm, no causality
    "attn": dict(base_channels=32, output_channels=1, ch_mult=(1, 2), num_res_blocks=2,
                 in_channels=1, latent_channels=4, norm_type="group", causality_axis="none",
                 attn_resolutions=(16,), mid_block_add_attention=True, mel_bins=15,
                 resolution=32),
}

VOCODER_CONFIGS = {
    # LTX-2's vocoder shape: leaky ReLU, tanh out; 80 samples at 8 kHz a mel frame: the 10 ms
    # of the audio VAE's 160-sample hop at 16 kHz, as LTX-2's 240 at 24 kHz
    "ltx2": dict(in_channels=2 * 16, hidden_channels=32, out_channels=2,
                 upsample_kernel_sizes=(11, 8, 8), upsample_factors=(5, 4, 4),
                 resnet_kernel_sizes=(3, 7), resnet_dilations=((1, 3), (1, 3, 5)),
                 output_sampling_rate=8000),
    # BigVGAN-style: anti-aliased snake-beta activations, no final activation, no bias
    "snake": dict(in_channels=2 * 16, hidden_channels=32, out_channels=2,
                  upsample_kernel_sizes=(5, 4), upsample_factors=(3, 2),
                  resnet_kernel_sizes=(3,), resnet_dilations=((1, 3),), act_fn="snakebeta",
                  antialias=True, final_act_fn=None, final_bias=False,
                  output_sampling_rate=16000),
}

VOCODER_GAIN = {"ltx2": 1.7, "snake": 1.0}      # weight scale: mean |wave| 0.2-0.6

# LTX-2.3's vocoder with bandwidth extension: 20 samples a mel frame at 8 kHz, then the
# extension to 16 kHz (its generator: 40 samples a frame of the 20-sample-hop STFT's mel)
BWE_CONFIG = dict(in_channels=2 * 16, hidden_channels=32, out_channels=2,
                  upsample_kernel_sizes=(11, 8), upsample_factors=(5, 4),
                  resnet_kernel_sizes=(3,), resnet_dilations=((1, 3),),
                  bwe_in_channels=2 * 16, bwe_hidden_channels=32, bwe_out_channels=2,
                  bwe_upsample_kernel_sizes=(11, 8, 4), bwe_upsample_factors=(5, 4, 2),
                  bwe_resnet_kernel_sizes=(3,), bwe_resnet_dilations=((1, 3),),
                  filter_length=64, hop_length=20, window_length=64, num_mel_channels=16,
                  input_sampling_rate=8000, output_sampling_rate=16000)


def _perturb(model: torch.nn.Module, names: tuple[str, ...], scale: float = 0.3) -> None:
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.split(".")[-1] in names:
                p.add_(torch.randn_like(p) * scale)
        for key, b in model.named_buffers():
            if key.split(".")[-1] in ("latents_mean", "latents_std"):
                b.copy_(torch.rand_like(b) + 0.5 if key.endswith("std") else
                        torch.randn_like(b) * 0.3)


def save_video_vae(name: str, path: Path) -> torch.nn.Module:
    from diffusers import AutoencoderKLLTX2Video
    torch.manual_seed(0)
    ref = AutoencoderKLLTX2Video(**VIDEO_CONFIGS[name]).eval()
    _perturb(ref, ("per_channel_scale1", "per_channel_scale2", "scale_shift_table",
                   "weight", "bias"), 0.05)
    ref.save_pretrained(path)
    return ref


def save_audio_vae(name: str, path: Path) -> torch.nn.Module:
    from diffusers import AutoencoderKLLTX2Audio
    torch.manual_seed(0)
    ref = AutoencoderKLLTX2Audio(**AUDIO_CONFIGS[name]).eval()
    _perturb(ref, ("weight", "bias"), 0.05)
    ref.save_pretrained(path)
    return ref


def save_vocoder(name: str, path: Path) -> torch.nn.Module:
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    torch.manual_seed(0)
    ref = LTX2Vocoder(**VOCODER_CONFIGS[name]).eval()
    with torch.no_grad():       # each fresh conv shrinks the signal: scale them to audible
        for key, p in ref.named_parameters():
            if key.endswith("weight"):
                p.mul_(VOCODER_GAIN[name])
    _perturb(ref, ("alpha", "beta"), 0.3)
    ref.save_pretrained(path)
    return ref


def save_vocoder_bwe(path: Path) -> torch.nn.Module:
    """The tiny LTX2VocoderWithBWE; its STFT basis a Hann-windowed DFT and its mel filterbank
    random (zeros in a fresh model: the checkpoint's in a real one)."""
    import math

    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE
    torch.manual_seed(0)
    ref = LTX2VocoderWithBWE(**BWE_CONFIG).eval()
    n = BWE_CONFIG["filter_length"]
    freqs = torch.arange(n // 2 + 1)[:, None] * torch.arange(n)[None] * 2 * math.pi / n
    window = torch.hann_window(n)
    basis = torch.cat([torch.cos(freqs), -torch.sin(freqs)]) * window
    with torch.no_grad():
        ref.mel_stft.stft_fn.forward_basis.copy_(basis[:, None])
        ref.mel_stft.stft_fn.inverse_basis.copy_(basis[:, None] / n)
        ref.mel_stft.mel_basis.copy_(torch.rand_like(ref.mel_stft.mel_basis) * 0.2)
    _perturb(ref, ("alpha", "beta"), 0.3)
    ref.save_pretrained(path)
    return ref
