"""Golden: our Qwen3-TTS (talker + code predictor, prompt layouts of the three modes, speaker
encoder, 12 Hz speech encoder and decoder) against the `qwen-tts` reference package, run in its
own environment on the same tiny random checkpoints, float32, greedy (conftest.py).

Every case goes through the reference's public API alone; ours run all cases of a model in one
batch (different prompt lengths), so equal codes also show batching invariance."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStream, decode_streams
from omnistage.models.qwen3_tts.prompt import SpeechRequest
from omnistage.models.qwen3_tts.talker import Qwen3TTSTalkerForCausalLM

from omnistage.testing.tiny_tts import CASES, CLIPS

WAV_ATOL = 1e-4        # samples in [-1, 1]; the reference's peak near 0.5
SPK_ATOL = 1e-5        # x-vector entries O(1)


def test_reference_is_audible(ref: dict) -> None:
    for name in CASES:
        peak = np.abs(ref[name]["wav0"]).max()
        assert 0.1 < peak < 1.0, (name, peak)
        assert ref[name]["codes0"].shape[0] >= 8, (name, ref[name]["codes0"].shape)


@pytest.mark.parametrize("name", list(CASES))
def test_codes_match_reference(name: str, ref: dict, ours: dict) -> None:
    np.testing.assert_array_equal(ours[name].numpy(), ref[name]["codes0"])


@pytest.mark.parametrize("name", ["icl", "icl_long_text"])
def test_speech_encoder_codes_match(name: str, ref: dict, models: dict) -> None:
    codes = models["encoder"].encode(torch.from_numpy(CLIPS[name]))
    assert codes.shape == (math.ceil(len(CLIPS[name]) / 1920), 4)
    np.testing.assert_array_equal(codes.numpy(), ref[name]["ref_code"])


@pytest.mark.parametrize("name", ["xvector", "icl_long_text"])
def test_speaker_embedding_matches(name: str, ref: dict, models: dict) -> None:
    ours = models["speaker"].embed_speaker(torch.from_numpy(CLIPS[name]))
    expected = torch.from_numpy(ref[name]["spk"])
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(ours, expected, atol=SPK_ATOL, rtol=0)


@pytest.mark.parametrize("name", ["preset", "design", "xvector", "icl"])
def test_waveform_matches_reference(name: str, ref: dict, ours: dict, models: dict) -> None:
    decoder = models["decoder"]
    codes = ours[name]
    prefix = 0
    if "ref_code" in ref[name]:       # a clone decodes after its reference frames, then cuts
        prefix = ref[name]["ref_code"].shape[0]
        codes = torch.cat([torch.from_numpy(ref[name]["ref_code"]), codes])
    wav = decoder.decode(codes.T[None])[0, 0, prefix * decoder.total_upsample:]
    expected = torch.from_numpy(ref[name]["wav0"])
    # the reference cuts int(prefix / frames * samples), which may keep one sample more
    assert 0 <= expected.shape[0] - wav.shape[0] <= 1, (expected.shape, wav.shape)
    torch.testing.assert_close(wav, expected[-wav.shape[0]:], atol=WAV_ATOL, rtol=0)


def test_streamed_decode_equals_whole(ref: dict, models: dict) -> None:
    """Several requests' streams decoded together, odd chunk sizes and pieces, first chunk
    short: each stream's concatenated samples are its whole decode."""
    decoder = models["decoder"]
    frames = [torch.from_numpy(ref[n]["codes0"]).T for n in ("preset", "design", "xvector")]
    streams = [Code2WavStream(decoder, chunk_frames=c, first_chunk_frames=f)
               for c, f in ((3, 1), (5, 2), (4, 3))]
    outs: list[list[torch.Tensor]] = [[] for _ in streams]
    for start in range(0, max(f.shape[1] for f in frames), 2):       # 2 frames a round
        for s, f in zip(streams, frames):
            if start < f.shape[1]:
                s.append(f[:, start:start + 2])
            if start + 2 >= f.shape[1] and not s.is_finished:
                s.finish()
        for out, wav in zip(outs, decode_streams(streams)):
            out.append(wav)
    for f, out, s in zip(frames, outs, streams):
        whole = decoder.decode(f[None])[0, 0]
        assert len([w for w in out if w.numel()]) >= 3, "several chunks"
        streamed = torch.cat(out)
        assert streamed.shape == whole.shape
        torch.testing.assert_close(streamed, whole, atol=WAV_ATOL, rtol=0)


def test_requests_are_checked(models: dict) -> None:
    custom, base = models["custom_voice"], models["base"]
    with pytest.raises(ValueError, match="speaker 'nobody'"):
        custom.build(SpeechRequest("Hi.", speaker="nobody"))
    with pytest.raises(ValueError, match="language 'klingon'"):
        custom.build(SpeechRequest("Hi.", language="klingon", speaker="vivian"))
    with pytest.raises(ValueError, match="text: empty"):
        custom.build(SpeechRequest("", speaker="vivian"))
    with pytest.raises(ValueError, match="needs one"):
        base.build(SpeechRequest("Hi."))
    with pytest.raises(ValueError, match="ref_text"):
        base.build(SpeechRequest("Hi.", speaker_embedding=torch.zeros(32),
                                 ref_code=torch.zeros(3, 4, dtype=torch.long)))


def test_loading_is_strict(ref: dict, tmp_path: Path) -> None:
    """A checkpoint missing a tensor of the talker names it."""
    src = ref["root"] / "voice_design"
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors["talker.text_projection.linear_fc1.bias"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="talker.text_projection.linear_fc1.bias"):
        Qwen3TTSTalkerForCausalLM.from_pretrained(dst)
