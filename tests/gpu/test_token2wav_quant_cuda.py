"""GPU-only (skipped without CUDA): Qwen2.5-Omni's streamed token2wav with its DiT's linears in
FP8 (compute capability 8.9 or newer) or INT8 (option `dit_quantization`), on the tiny
checkpoint (its linears are 32 and 64 wide: `dit_quantization_min_features` 16): as the
stage runs it on CUDA (DiT in bfloat16, blocks compiled, CUDA graphs) against the same
quantization eager and uncompiled, and against the float32 DiT unquantized (waveform SNR,
printed; the bench shape's is bench omni25's `omni25_waveform_snr_db`).

    pytest -q -s -m gpu tests/gpu/test_token2wav_quant_cuda.py
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from omnistage.generation.token2wav import Token2WavGenerator, Token2WavOptions
from omnistage.layers.fp8 import Fp8Linear
from omnistage.layers.int8 import Int8Linear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")
LAYERS = {"fp8": Fp8Linear, "int8": Int8Linear}


def decode(gen: Token2WavGenerator, codes: torch.Tensor, per_call: int = 4) -> torch.Tensor:
    """One request (speaker 0) fed `per_call` codes a call until no backlog: its audio."""
    state: dict = {}
    pieces = []
    with torch.inference_mode():
        for call in range(1000):
            x = codes[call * per_call:(call + 1) * per_call]
            out, = gen.generate([{"codes": x, "speaker": torch.zeros_like(x)} if x.numel()
                                 else {}], [state], [(call + 1) * per_call >= codes.numel()])
            if out:
                pieces.append(out["audio"].float())
            if (call + 1) * per_call >= codes.numel() and not gen.has_backlog(state):
                return torch.cat(pieces)
    raise AssertionError("token2wav did not finish in 1000 calls")


def snr_db(audio: torch.Tensor, reference: torch.Tensor) -> float:
    assert audio.shape == reference.shape
    err = (audio - reference).pow(2).sum().item()
    return 10 * math.log10(reference.pow(2).sum().item() / max(err, 1e-30))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.testing.tiny_qwen2_5_omni import build_tiny_qwen2_5_omni

    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("omni25"))


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_quantized_dit_graphed_and_compiled(ckpt: Path, method: str) -> None:
    if method == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9 or newer")
    codes = torch.randint(0, 64, (48,), generator=torch.Generator().manual_seed(0))
    options = dict(dit_quantization=method, dit_quantization_min_features=16)
    reference = decode(Token2WavGenerator.from_pretrained(
        ckpt, "", CUDA, None, Token2WavOptions(dit_dtype="float32", compile=False)), codes)
    eager = Token2WavGenerator.from_pretrained(ckpt, "", CUDA, None, Token2WavOptions(
        cuda_graphs=False, compile=False, **options))
    staged = Token2WavGenerator.from_pretrained(ckpt, "", CUDA, None,
                                                Token2WavOptions(**options))
    assert staged.graphs is not None
    swapped = [n for n, m in staged.model.dit.named_modules() if isinstance(m, LAYERS[method])]
    assert len(swapped) == 12, swapped            # 3 blocks x (qkv, out, 2 MLP)
    a, b = decode(staged, codes), decode(eager, codes)
    print(f"\n{method}: staged vs eager {snr_db(a, b):.1f} dB, staged vs float32 "
          f"{snr_db(a, reference):.1f} dB, eager vs float32 {snr_db(b, reference):.1f} dB")
    assert reference.abs().max() > 0.1 and torch.isfinite(a).all()
    assert snr_db(a, b) >= 30 and snr_db(a, reference) >= 30
