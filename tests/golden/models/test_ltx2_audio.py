"""LTX-2's sound path against diffusers on tiny random checkpoints in float32: the audio VAE
(`AutoencoderKLLTX2Audio`: LTX-2's causal pixel-norm shape, and a group-norm one with attention)
decoding mel latents to mel spectrograms and encoding them back, and the vocoder (`LTX2Vocoder`:
LTX-2's leaky-ReLU shape, and anti-aliased snake-beta; LTX-2.3's `LTX2VocoderWithBWE`, its
bandwidth extension to twice the rate) from mel to waveform, each alone and chained as
LTX2Pipeline chains them; the waveform within 1e-4 at an audible magnitude."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.autoencoder_kl_ltx2_audio import AutoencoderKLLTX2Audio
from omnistage.models.ltx2_vocoder import LTX2Vocoder, LTX2VocoderWithBWE, load_vocoder
from tests.helpers.ltx2_vae import (AUDIO_CONFIGS, BWE_CONFIG, VOCODER_CONFIGS, save_audio_vae,
                                    save_vocoder, save_vocoder_bwe)

diffusers = pytest.importorskip("diffusers")

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module", params=sorted(AUDIO_CONFIGS))
def audio_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, torch.nn.Module, AutoencoderKLLTX2Audio]:
    path = tmp_path_factory.mktemp(request.param)
    ref = save_audio_vae(request.param, path)
    return request.param, ref, AutoencoderKLLTX2Audio.from_pretrained(path)


@pytest.fixture(scope="module", params=sorted(VOCODER_CONFIGS))
def vocoder_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[str, torch.nn.Module, LTX2Vocoder, Path]:
    path = tmp_path_factory.mktemp(request.param)
    ref = save_vocoder(request.param, path)
    return request.param, ref, LTX2Vocoder.from_pretrained(path), path


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("frames", [1, 7])
@torch.no_grad()
def test_audio_decode_matches_diffusers(audio_pair: tuple, frames: int) -> None:
    name, ref, ours = audio_pair
    latents = torch.randn(2, 4, frames, 4, generator=torch.Generator().manual_seed(1))
    mel = ours.decode(latents)
    cfg = AUDIO_CONFIGS[name]
    assert mel.shape == (2, cfg["output_channels"], max(4 * frames - 3, 1), cfg["mel_bins"])
    assert mel.std() > 0.05
    assert max_diff(mel, ref.decode(latents).sample) < 1e-5
    assert max_diff(mel[0], mel[1]) > 1e-2


@torch.no_grad()
def test_audio_encode_matches_diffusers(audio_pair: tuple) -> None:
    name, ref, ours = audio_pair
    cfg = AUDIO_CONFIGS[name]
    mel = torch.randn(2, cfg["in_channels"], 21, cfg["mel_bins"] + 1,
                      generator=torch.Generator().manual_seed(2))
    expected = ref.encode(mel).latent_dist.mean
    assert expected.std() > 0.05
    assert max_diff(ours.encode(mel), expected) < 1e-5


def test_audio_latent_packing_matches_the_pipeline(audio_pair: tuple) -> None:
    from diffusers import LTX2Pipeline
    _, ref, ours = audio_pair
    with torch.no_grad():
        ref.latents_mean.normal_()
        ref.latents_std.uniform_(0.5, 1.5)
        ours.latents_mean.copy_(ref.latents_mean)
        ours.latents_std.copy_(ref.latents_std)
    latents = torch.randn(2, 4, 5, ours.latent_mel_bins)
    if ours.cfg.base_channels != 4 * ours.latent_mel_bins:
        pytest.skip("statistics per packed feature need base_channels = z * mel bins / 4")
    packed = LTX2Pipeline._pack_audio_latents(latents)
    assert max_diff(ours.pack(latents), packed) == 0.0
    normed = LTX2Pipeline._normalize_audio_latents(packed, ref.latents_mean, ref.latents_std)
    assert max_diff(ours.normalize(packed), normed) < 1e-6
    assert max_diff(ours.denormalize(normed), packed) < 1e-5
    unpacked = LTX2Pipeline._unpack_audio_latents(packed, 5, num_mel_bins=ours.latent_mel_bins)
    assert max_diff(ours.unpack(packed), unpacked) == 0.0


@torch.no_grad()
def test_vocoder_matches_diffusers(vocoder_pair: tuple) -> None:
    _, ref, ours, _ = vocoder_pair
    mel = torch.randn(2, 2, 13, 16, generator=torch.Generator().manual_seed(3)) * 2 - 4
    wave = ours(mel)
    assert wave.shape == (2, 2, 13 * ours.hop_length)
    assert wave.abs().mean() > 0.1                  # audible-size, not 1e-6
    assert max_diff(wave, ref(mel)) < 1e-4
    assert ours.sample_rate == ref.config.output_sampling_rate


@torch.no_grad()
def test_mel_latents_to_waveform_as_the_pipeline(tmp_path: Path) -> None:
    """LTX2Pipeline's tail: audio_vae.decode, then the vocoder on its mel."""
    ref_vae = save_audio_vae("ltx2", tmp_path / "audio_vae")
    ref_voc = save_vocoder("ltx2", tmp_path / "vocoder")
    vae = AutoencoderKLLTX2Audio.from_pretrained(tmp_path / "audio_vae")
    voc = LTX2Vocoder.from_pretrained(tmp_path / "vocoder")
    latents = torch.randn(2, 4, 6, 4, generator=torch.Generator().manual_seed(4))
    expected = ref_voc(ref_vae.decode(latents).sample)
    wave = voc(vae.decode(latents))
    assert wave.shape == (2, 2, 21 * voc.hop_length)
    assert wave.abs().mean() > 0.02          # the tiny VAE's mel is quieter than log-mel
    assert max_diff(wave, expected) < 1e-4


@torch.no_grad()
def test_a_plausible_bug_fails(vocoder_pair: tuple) -> None:
    """The comparison can tell: mel bins and frames swapped change the waveform."""
    _, ref, ours, _ = vocoder_pair
    mel = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(5)) * 2 - 4
    assert max_diff(ours(mel.transpose(2, 3)), ref(mel)) > 1e-2


def test_bad_input_and_strict_loading(vocoder_pair: tuple, tmp_path: Path) -> None:
    _, _, ours, path = vocoder_pair
    with pytest.raises(ValueError, match="mel"):
        ours(torch.zeros(1, 3, 4, 16))
    tensors = load_file(path / WEIGHTS)
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    missing = {k: v for k, v in tensors.items() if k != "conv_in.weight"}
    save_file(missing, tmp_path / WEIGHTS)
    with pytest.raises(ValueError, match="conv_in.weight"):
        LTX2Vocoder.from_pretrained(tmp_path)


@torch.no_grad()
def test_bandwidth_extended_vocoder_matches_diffusers(tmp_path: Path) -> None:
    ref = save_vocoder_bwe(tmp_path)
    ours = load_vocoder(tmp_path)
    assert isinstance(ours, LTX2VocoderWithBWE)
    assert ours.sample_rate == BWE_CONFIG["output_sampling_rate"]
    mel = torch.randn(2, 2, 13, 16, generator=torch.Generator().manual_seed(6)) * 2 - 4
    wave = ours(mel)
    assert wave.shape == (2, 2, 13 * 20 * 2)             # 20 samples a frame at 8 kHz, x 2
    assert wave.abs().mean() > 0.1 and (wave.abs() > 0.999).float().mean() < 0.01
    expected = ref(mel)
    assert max_diff(wave, expected) < 1e-4
    assert max_diff(ours.vocoder(mel), ref.vocoder(mel)) < 1e-4
    with pytest.raises(ValueError, match="LTX2VocoderWithBWE"):
        LTX2Vocoder.from_pretrained(tmp_path)
