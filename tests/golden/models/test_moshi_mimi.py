"""Golden: our Mimi codec (omnistage/models/moshi/mimi.py) against transformers' `MimiModel` on
the same tiny random checkpoint (built and saved by transformers, loaded by our loader): codes
identical for a batch of two odd-length clips, the decoded waveform within 1e-4 at audible
magnitude, and encoding and decoding streamed frame by frame (or a few frames at a time) equal
to whole."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.moshi.mimi import MimiModel
from omnistage.testing.tiny_moshi import build_tiny_mimi


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path, ref = build_tiny_mimi(tmp_path_factory.mktemp("mimi") / "mimi")
    return MimiModel.from_pretrained(path), ref


@pytest.fixture(scope="module")
def wav():
    g = torch.Generator().manual_seed(3)
    return 0.5 * torch.randn(2, 1, 96 * 9 - 13, generator=g)    # 9 frames, the last partial


def test_encode_codes_identical(models, wav):
    ours, ref = models
    with torch.no_grad():
        want = ref.encode(wav).audio_codes
        want3 = ref.encode(wav, num_quantizers=3).audio_codes
    assert want.shape == (2, 4, 9)
    assert len(want.unique()) > 16                               # not a degenerate codebook
    assert torch.equal(ours.encode(wav), want)
    assert torch.equal(ours.encode(wav, 3), want3)


def test_decode_waveform_close(models, wav):
    ours, ref = models
    with torch.no_grad():
        codes = ref.encode(wav).audio_codes
        want = ref.decode(codes).audio_values
        want3 = ref.decode(codes[:, :3]).audio_values
    assert want.shape == (2, 1, 9 * 96)
    assert want.abs().max() > 0.5 and want.std() > 0.05          # audible, not near zero
    torch.testing.assert_close(ours.decode(codes), want, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.decode(codes[:, :3]), want3, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_streamed_decode_equals_whole(models, wav, chunk):
    ours, _ = models
    codes = ours.encode(wav)
    whole = ours.decode(codes)
    state = ours.new_decode_state()
    parts = [ours.decode_step(codes[..., i:i + chunk], state)
             for i in range(0, codes.shape[-1], chunk)]
    assert [p.shape[-1] for p in parts][0] == chunk * 96        # each call's own samples
    torch.testing.assert_close(torch.cat(parts, -1), whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_encode_equals_whole(models, wav, chunk):
    ours, ref = models
    aligned = wav[..., :96 * 8]                                  # a stream takes whole frames
    with torch.no_grad():
        want = ref.encode(aligned).audio_codes
    state = ours.new_encode_state()
    parts = [ours.encode_step(aligned[..., i * 96:(i + chunk) * 96], None, state)
             for i in range(0, 8, chunk)]
    assert torch.equal(torch.cat(parts, -1), want)
    with pytest.raises(ValueError, match="whole frames"):
        ours.encode_step(wav[..., :100], None, ours.new_encode_state())
