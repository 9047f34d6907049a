"""Voxtral-TTS's codec decoder, generation head and packed audio embedding on our layers, golden
against vLLM-Omni's modules (linyueqian/vllm-omni@0342827, float32, flash-attn absent so the
codec's SDPA path): the tiny seeded checkpoint in the release's layout (params.json +
consolidated.safetensors) and the reference's outputs come from scripts/voxtral_tts_fixtures.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from omnistage.models.voxtral_tts import VoxtralAudioEmbedding, VoxtralCodecDecoder, \
    VoxtralFlowHead, read_params
from omnistage.models.voxtral_tts.codec import _Attention, decoder_windows

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "voxtral_tts"
TINY = FIXTURES / "tiny"


@pytest.fixture(scope="module")
def fx() -> dict:
    return load_file(FIXTURES / "expected.safetensors")


@pytest.fixture(scope="module")
def codec() -> VoxtralCodecDecoder:
    return VoxtralCodecDecoder.from_pretrained(TINY)


@pytest.fixture(scope="module")
def head() -> VoxtralFlowHead:
    return VoxtralFlowHead.from_pretrained(TINY)


def test_waveform_matches_upstream_decode(fx: dict, codec: VoxtralCodecDecoder) -> None:
    ref = fx["codec_wav"].squeeze(1)             # (2, 7 frames * 8 * 8 samples)
    assert ref.std() > 0.5                       # audible, not a near-zero reference
    out = codec(fx["codec_codes"])
    assert out.shape == ref.shape == (2, 7 * 64)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_windows_replay_the_encoders_halving(codec: VoxtralCodecDecoder) -> None:
    assert decoder_windows(codec.cfg) == [2, 4, 8, 16]


def test_a_wrong_window_or_slope_fails(fx: dict, codec: VoxtralCodecDecoder) -> None:
    attns = [m for m in codec.modules() if isinstance(m, _Attention)]
    saved = [(a.window, a.slopes.clone()) for a in attns]
    try:
        for a in attns:
            a.window = 16                        # the configured window everywhere
        assert (codec(fx["codec_codes"]) - fx["codec_wav"].squeeze(1)).abs().max() > 1e-2
        for a, (w, s) in zip(attns, saved):
            a.window = w
            a.slopes = s.flip(0)                 # slopes in the wrong head order
        assert (codec(fx["codec_codes"]) - fx["codec_wav"].squeeze(1)).abs().max() > 1e-2
    finally:
        for a, (w, s) in zip(attns, saved):
            a.window, a.slopes = w, s


def test_frame_codes_identical(fx: dict, head: VoxtralFlowHead) -> None:
    out = head(fx["head_hidden"], fx["head_cfg_alpha"], fx["head_noise"])
    assert torch.equal(out, fx["head_codes"])
    assert out[2, 0] == 1 and out[0, 0] > 1      # one row ends the utterance, one speaks
    assert len(set(out[:2, 1:].flatten().tolist())) > 3


def test_velocity_matches(fx: dict, head: VoxtralFlowHead) -> None:
    t = head.time_embedding(torch.full((3, 1), 2 / 7))
    v = head.velocity(fx["head_noise"], fx["head_hidden"], t)
    assert fx["head_velocity_t2"].abs().max() > 0.5
    torch.testing.assert_close(v, fx["head_velocity_t2"], atol=1e-5, rtol=1e-5)


def test_guidance_and_step_count_matter(fx: dict, head: VoxtralFlowHead) -> None:
    args = fx["head_hidden"], fx["head_noise"]
    no_cfg = head.acoustic(args[0], torch.ones(3), args[1])
    assert not torch.equal(no_cfg[0] + 2, fx["head_codes"][0, 1:])      # row 0 has a = 1.2
    assert torch.equal(no_cfg[1] + 2, fx["head_codes"][1, 1:])          # row 1 has a = 1.0


def test_packed_embedding_matches(fx: dict) -> None:
    emb = VoxtralAudioEmbedding.from_pretrained(TINY)
    out = emb(fx["embed_codes"].transpose(1, 2))                         # (2, 3 frames, 7)
    torch.testing.assert_close(out, fx["embed_sum"], atol=1e-6, rtol=1e-6)


def test_params_read_and_bad_folders_refused(tmp_path: Path) -> None:
    params, head_cfg, codec_cfg = read_params(TINY)
    assert head_cfg.n_decoding_steps == 7 and codec_cfg.voices == {"tiny_voice": 0}
    assert codec_cfg.samples_per_frame == 64 and head_cfg.semantic_out_size == 128
    with pytest.raises(ValueError, match="params.json"):
        read_params(tmp_path)
    (tmp_path / "params.json").write_text(json.dumps({"dim": 8, "multimodal": {}}))
    with pytest.raises(ValueError, match="audio_model_args"):
        read_params(tmp_path)
