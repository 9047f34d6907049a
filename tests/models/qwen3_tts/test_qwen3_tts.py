"""Golden: our Qwen3-TTS (talker + code predictor, prompt layouts of the three modes, speaker
encoder, 12 Hz speech encoder and decoder) against the `qwen-tts` reference package, run in its
own environment on the same tiny random checkpoints, float32, greedy.

Every request below goes through the reference's public API alone; ours run all requests of a
model in one batch (different prompt lengths), so equal codes also show batching invariance."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from omnistage.models.qwen3_omni.code2wav_stream import Code2WavStream, decode_streams
from omnistage.models.qwen3_tts.config import Qwen3TTSConfig
from omnistage.models.qwen3_tts.prompt import PromptBuilder, SpeechRequest
from omnistage.models.qwen3_tts.speaker_encoder import Qwen3TTSSpeakerEncoder
from omnistage.models.qwen3_tts.speech_decoder import Qwen3TTSSpeechDecoder
from omnistage.models.qwen3_tts.speech_encoder import Qwen3TTSSpeechEncoder
from omnistage.models.qwen3_tts.talker import Qwen3TTSTalkerForCausalLM
from omnistage.testing.tiny_tts import greedy_speech, reference_missing, run_reference

WAV_ATOL = 1e-4        # samples in [-1, 1]; the reference's peak near 0.5
SPK_ATOL = 1e-5        # x-vector entries O(1)
MAX_TOKENS = 14


def clip(seconds: float, freq: float, seed: int) -> np.ndarray:
    """A 24 kHz tone with noise: a reference clip for voice cloning."""
    t = np.arange(int(24000 * seconds)) / 24000
    noise = np.random.default_rng(seed).standard_normal(t.shape)
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * noise).astype(np.float32)


LONG_CLIP, SHORT_CLIP = clip(2.0, 220.0, 1), clip(0.4, 330.0, 2)
# (mode, reference request, our request (no clone fields: the test fills them in))
CASES = {
    "preset": ("custom_voice", dict(text="Hello world.", speaker="Vivian", language="English",
                                    instruct="Speak slowly and warmly.")),
    "dialect": ("custom_voice", dict(text="Numbers like 42 appear in text too.",
                                     speaker="Dylan", language="Chinese",
                                     non_streaming_mode=False)),
    "no_speaker": ("custom_voice", dict(text="The sun rises.", speaker="", language="Auto")),
    "design": ("voice_design", dict(text="The sun rises in the east and sets in the west.",
                                    instruct="A deep, calm voice.", language="English")),
    "design_streaming": ("voice_design", dict(text="One, two, three.", instruct="Bright.",
                                              language="Auto", non_streaming_mode=False)),
    "xvector": ("base", dict(text="The quick brown fox.", language="English")),
    "icl": ("base", dict(text="She sells sea shells.", language="Auto",
                         ref_text="Hello world.")),
    "icl_long_text": ("base", dict(text="To be, or not to be, that is the question.",
                                   language="English", ref_text="Hi.")),
    "icl_non_streaming": ("base", dict(text="Grüße aus München.", language="Auto",
                                       ref_text="Hello world.", non_streaming_mode=True)),
}
CLIPS = {"xvector": LONG_CLIP, "icl": LONG_CLIP, "icl_long_text": SHORT_CLIP,
         "icl_non_streaming": SHORT_CLIP}


def reference_request(name: str) -> dict:
    mode, fields = CASES[name]
    req = {"mode": mode, "max_new_tokens": MAX_TOKENS, **fields}
    if name in CLIPS:
        req.update(ref_audio=CLIPS[name].tolist(), x_vector_only="ref_text" not in fields)
    return req


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> dict:
    missing = reference_missing()
    if missing:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp("qwen3_tts")
    out = run_reference(root, [reference_request(n) for n in CASES])
    by_name = {name: {k.split(".", 1)[1]: v for k, v in out.items() if k.startswith(f"{i}.")}
               for i, name in enumerate(CASES)}
    return {"root": root, **by_name}


@pytest.fixture(scope="module")
def models(ref: dict) -> dict:
    root: Path = ref["root"]
    out = {}
    for mode in ("custom_voice", "voice_design", "base"):
        talker = Qwen3TTSTalkerForCausalLM.from_pretrained(root / mode)
        out[mode] = PromptBuilder(Qwen3TTSConfig.from_pretrained(root / mode), talker,
                                  AutoTokenizer.from_pretrained(root / mode))
    out["decoder"] = Qwen3TTSSpeechDecoder.from_pretrained(root / "base" / "speech_tokenizer")
    out["encoder"] = Qwen3TTSSpeechEncoder.from_pretrained(root / "base" / "speech_tokenizer")
    out["speaker"] = Qwen3TTSSpeakerEncoder.from_pretrained(root / "base")
    return out


def our_request(name: str, models: dict) -> SpeechRequest:
    _, fields = CASES[name]
    fields = dict(fields)
    fields["speaker"] = fields.get("speaker") or None
    if name in CLIPS:
        wav = torch.from_numpy(CLIPS[name])
        fields["speaker_embedding"] = models["speaker"].embed_speaker(wav)
        if "ref_text" in fields:
            fields["ref_code"] = models["encoder"].encode(wav)
    return SpeechRequest(**fields)


@pytest.fixture(scope="module")
def ours(models: dict) -> dict:
    """Our greedy frames of every case: one batch per model."""
    out = {}
    for mode in ("custom_voice", "voice_design", "base"):
        names = [n for n, (m, _) in CASES.items() if m == mode]
        builder = models[mode]
        prompts = [builder.build(our_request(n, models)) for n in names]
        assert len({p.embeds.shape[0] for p in prompts}) == len(prompts), "lengths must differ"
        out.update(zip(names, greedy_speech(builder.talker, prompts, MAX_TOKENS)))
    return out


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
