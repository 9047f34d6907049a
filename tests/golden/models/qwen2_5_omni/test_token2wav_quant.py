"""Qwen2.5-Omni token2wav with its DiT's linears quantized (option `dit_quantization`) on the
tiny checkpoint: the streamed waveform against the float32 one (same codes, same noise), as
bench omni25 measures it at the bench shape (`omni25_waveform_snr_db`). int8 runs on the CPU
through the option; fp8 through `quantize_dit(allow_cpu=True)` (torch's CPU `_scaled_mm`),
since the option refuses a device without FP8 tensor cores.

Measured here (60 codes, speaker 1, the tiny DiT's 12 block linears swapped): int8 60.0 dB,
fp8 46.9 dB (the DiT in bfloat16, unquantized: 49.8 dB); every int8 weight scale doubled, a
broken swap, gives 17.2 dB. The tiny DiT is 32 wide with random weights, so these say little
about the bench shape's (the device run's); the bounds hold each 7-10 dB under its figure,
far above the broken one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from omnistage.generation.token2wav import Token2WavGenerator, Token2WavOptions, quantize_dit
from omnistage.layers.fp8 import Fp8Linear
from omnistage.layers.int8 import Int8Linear
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav
from omnistage.payloads import AudioChunk, CodecFrames

CPU = torch.device("cpu")
MIN_FEATURES = 16          # the tiny DiT's linears are 32 and 64 wide
INT8_MIN_SNR_DB = 50.0
FP8_MIN_SNR_DB = 40.0
# each of the tiny DiT's 3 blocks (q, k and v fused by the generator: Token2WavDiT.fuse_qkv)
BLOCK_LINEARS = ("attn.to_out.0", "attn.to_qkv", "ff.ff.0", "ff.ff.3")


def generator(path: Path, **options: object) -> Token2WavGenerator:
    return Token2WavGenerator.from_pretrained(path, "", CPU, None, Token2WavOptions(
        first_chunk_blocks=6, dit_quantization_min_features=MIN_FEATURES, **options))


def decode(gen: Token2WavGenerator, codes: torch.Tensor, per_call: int = 4) -> torch.Tensor:
    """One request's codes (speaker 1) fed `per_call` a call, stepped until nothing is held
    back: its waveform."""
    state: dict = {}
    fed, pieces = 0, []
    with torch.inference_mode():
        for _ in range(1000):
            x = codes[fed:fed + per_call]
            fed += x.numel()
            inputs = CodecFrames(x, speaker=torch.ones_like(x)).pack() if x.numel() else {}
            (out,) = gen.generate([inputs], [state], [fed >= codes.numel()])
            chunk = AudioChunk.unpack(out)
            if chunk is not None and chunk.samples is not None:
                pieces.append(chunk.samples)
            if fed >= codes.numel() and not gen.has_backlog(state):
                return torch.cat(pieces)
    raise AssertionError("token2wav did not finish in 1000 calls")


def snr_db(audio: torch.Tensor, reference: torch.Tensor) -> float:
    assert audio.shape == reference.shape
    err = (audio - reference).pow(2).sum().item()
    return 10 * math.log10(reference.pow(2).sum().item() / max(err, 1e-30))


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    return torch.randint(0, 64, (60,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def reference(omni25_path: Path, codes: torch.Tensor) -> torch.Tensor:
    audio = decode(generator(omni25_path, dit_dtype="float32"), codes)
    assert 0.1 < audio.abs().max() < 0.99, "audible, not clamped"
    return audio


def swapped(gen: Token2WavGenerator, kind: type) -> list[str]:
    return [name for name, m in gen.model.dit.named_modules() if isinstance(m, kind)]


def test_int8_option_swaps_the_block_linears_within_the_snr(
        omni25_path: Path, codes: torch.Tensor, reference: torch.Tensor) -> None:
    gen = generator(omni25_path, dit_quantization="int8")
    expected = [f"transformer_blocks.{i}.{n}" for i in range(3) for n in BLOCK_LINEARS]
    assert swapped(gen, Int8Linear) == expected, "every block linear, nothing kept swapped"
    audio = decode(gen, codes)
    snr = snr_db(audio, reference)
    assert INT8_MIN_SNR_DB <= snr < 120, f"int8 waveform SNR {snr:.1f} dB"


def test_fp8_dit_within_the_snr(omni25_path: Path, codes: torch.Tensor,
                                reference: torch.Tensor) -> None:
    gen = generator(omni25_path, dit_dtype="float32")
    names = quantize_dit(gen.model.dit, "fp8", MIN_FEATURES, allow_cpu=True)
    assert names == swapped(gen, Fp8Linear) and len(names) == 3 * len(BLOCK_LINEARS)
    snr = snr_db(decode(gen, codes), reference)
    assert FP8_MIN_SNR_DB <= snr < 120, f"fp8 waveform SNR {snr:.1f} dB"


def test_default_min_features_keeps_the_tiny_dit_whole(omni25_path: Path) -> None:
    """Linears narrower than MIN_FEATURES (1024) stay: the tiny DiT's all do."""
    gen = Token2WavGenerator.from_pretrained(omni25_path, "", CPU, None,
                                             Token2WavOptions(dit_quantization="int8"))
    assert swapped(gen, Int8Linear) == []


def test_fp8_refused_off_fp8_gpus(omni25_path: Path) -> None:
    with pytest.raises(ValueError, match=r"dit_quantization=fp8: .*compute capability 8\.9"):
        generator(omni25_path, dit_quantization="fp8")


def test_fused_qkv_gives_the_same_velocity(omni25_path: Path) -> None:
    """Token2WavDiT.fuse_qkv (the generator's, at load): one matmul of the stacked q / k / v
    weights gives the three's velocity, padded rows and all, at float32 rounding."""
    dit = Token2Wav.from_pretrained(omni25_path).dit
    cfg, gen = dit.cfg, torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, cfg.mel_dim, generator=gen)
    args = (x, torch.tensor([0.2, 0.7]), torch.randn(2, cfg.enc_emb_dim, generator=gen),
            torch.randn(2, cfg.enc_dim, generator=gen),
            torch.randint(0, 64, (2, 24 // cfg.repeats), generator=gen), torch.tensor([24, 17]))
    with torch.inference_mode():
        before = dit(*args)
        dit.fuse_qkv()
        dit.fuse_qkv()                                  # a second generator: nothing more
        after = dit(*args)
    assert dit.transformer_blocks[0].attn.to_qkv is not None
    assert not any(name.endswith("to_q") for name, _ in dit.named_modules())
    assert before.abs().max() > 0.1
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(after[1, :17], before[1, :17], rtol=0, atol=1e-5)
