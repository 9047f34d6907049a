"""Resampling at any pair of rates: the polyphase bank where it is small (bit for bit what it
was), the same filter evaluated per output sample elsewhere (coprime rates), memory bounded by
the audio's length, and rates outside MIN_SAMPLE_RATE .. MAX_SAMPLE_RATE refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from omnistage.utils.audio import (MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, _resample_direct,
                                   check_sample_rate, resample)


def old_resample(waveform: np.ndarray, orig_sr: int, target_sr: int, zero_crossings: int = 6,
                 rolloff: float = 0.99) -> np.ndarray:
    """The resampler before issue 37 (a filter bank of target x orig taps when the rates
    share no factor), kept as the reference for commensurate rates."""
    g = math.gcd(orig_sr, target_sr)
    up, down = target_sr // g, orig_sr // g
    cutoff = min(up, down) * rolloff
    half_width = math.ceil(zero_crossings * down / cutoff)
    taps = torch.arange(-half_width, half_width + down, dtype=torch.float64) / down
    t = (taps[None, :] - torch.arange(up, dtype=torch.float64)[:, None] / up) * cutoff
    t = t.clamp(-zero_crossings, zero_crossings)
    window = torch.cos(t * math.pi / zero_crossings / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / torch.where(t == 0, 1, t))
    kernels = (sinc * window * cutoff / down).float()
    x = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32))
    x = F.pad(x[None, None], (half_width, half_width + down))
    y = F.conv1d(x, kernels[:, None, :], stride=down)
    y = y[0].T.reshape(-1)
    return y[: math.ceil(up * waveform.shape[0] / down)].numpy()


def noise(seconds: float, rate: int) -> np.ndarray:
    return (0.3 * np.random.default_rng(rate).standard_normal(int(seconds * rate))
            ).astype(np.float32)


def sine(freq: float, seconds: float, rate: int, phase: float = 0.0) -> np.ndarray:
    return np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate + phase)


COMMENSURATE = [(16000, 24000), (44100, 16000), (22050, 16000), (48000, 16000), (24000, 8000),
                (8000, 22050)]


@pytest.mark.parametrize("orig, target", COMMENSURATE)
def test_commensurate_rates_resample_as_before(orig: int, target: int) -> None:
    x = noise(0.7, orig)
    old = old_resample(x, orig, target)
    np.testing.assert_array_equal(resample(x, orig, target), old)          # the bank, as was
    g = math.gcd(orig, target)                                   # per output sample: the same
    up, down = target // g, orig // g                            # filter, float rounding apart
    half_width = math.ceil(6 * down / (min(up, down) * 0.99))
    direct = _resample_direct(x, up, down, half_width, 6, min(up, down) * 0.99 / down)
    assert direct.shape == old.shape
    assert np.abs(direct - old).max() < 1e-5


@pytest.mark.parametrize("orig, target", [(7919, 24000), (24000, 7919), (8001, 16000),
                                          (44100, 8001), (4001, 24000), (16000, 15999)])
def test_a_sine_keeps_its_shape_at_coprime_rates(orig: int, target: int) -> None:
    x = sine(317.0, 0.5, orig).astype(np.float32)
    out = resample(x, orig, target)
    assert out.dtype == np.float32 and out.shape == (math.ceil(len(x) * target / orig),)
    expected = np.sin(2 * np.pi * 317.0 * np.arange(len(out)) / target)
    inner = slice(len(out) // 10, -len(out) // 10)                       # away from the edges
    err = out[inner] - expected[inner]
    snr_db = 10 * np.log10(np.mean(expected[inner] ** 2) / np.mean(err ** 2))
    assert snr_db > 60, (orig, target, snr_db)


def test_content_above_the_new_nyquist_is_removed_at_coprime_rates() -> None:
    high = sine(6000.0, 0.5, 44100).astype(np.float32)              # above 8001 / 2
    assert np.abs(resample(high, 44100, 8001)[400:-400]).max() < 1e-2


PAIRS = [(2999, 4001), (7919, 24000), (24000, 7919), (8001, 24000), (383_987, 1_009),
         (1_009, 48_017)]             # cheapest first: before the fix the first took a gigabyte


@pytest.mark.parametrize("rate", [0, -16000, MIN_SAMPLE_RATE - 1, 500, MAX_SAMPLE_RATE + 1,
                                  2_000_000])
def test_rates_out_of_range_are_refused(rate: int) -> None:
    with pytest.raises(ValueError, match=f"{rate} Hz is outside {MIN_SAMPLE_RATE} to "
                                         f"{MAX_SAMPLE_RATE} Hz"):
        check_sample_rate(rate)
    with pytest.raises(ValueError, match="outside"):
        resample(np.zeros(100, np.float32), rate, 16000)
    with pytest.raises(ValueError, match="outside"):
        resample(np.zeros(100, np.float32), 16000, rate)
    assert check_sample_rate(MIN_SAMPLE_RATE) == MIN_SAMPLE_RATE
    assert check_sample_rate(MAX_SAMPLE_RATE) == MAX_SAMPLE_RATE
