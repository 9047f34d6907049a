"""Qwen2.5-Omni with a video's audio track (`use_audio_in_video`) through the stage runtime
(thinker -> talker -> token2wav) against transformers on the tiny random checkpoint, float32,
greedy: the interleaved prompt's encoder outputs merged at their placeholders and its 3-D
positions give the thinker's text of `thinker.generate(use_audio_in_video=True)`, and the whole
graph the text and waveform of `generate(return_audio=True, use_audio_in_video=True)`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage import Omni, SamplingParams
from omnistage.testing.tiny_qwen2_5_omni import CODEC_EOS, CODEC_PAD, mask_the_talker
from tests.helpers.audio_in_video import frames, tone

THINKER_TOKENS = 8
TALKER_TOKENS = 30
SEED = 3


@pytest.fixture(scope="module")
def omni(omni25_path: Path):
    with Omni(str(omni25_path), device="cpu", backend="inproc", connector="inproc",
              stage_overrides=[f"token2wav.generation.options.seed={SEED}",
                               "token2wav.generation.options.chunk_blocks=0",
                               f"talker.ar.sampling.max_tokens={TALKER_TOKENS}"]) as engine:
        yield engine


def greedy() -> list:
    talker = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=TALKER_TOKENS,
                            extra={"speaker": "Chelsie"})
    return [SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS), talker, None]


def chat(seconds: float = 5.0, num_frames: int = 10) -> list[dict]:
    """A video (2 fps) with its track: 3 chunks of 2 s, video and audio tokens interleaved."""
    return [{"role": "user", "content": [
        {"type": "video", "video": frames(num_frames, 32, 24), "fps": 2.0,
         "audio": (tone(seconds, seed=4), 16000)},
        {"type": "text", "text": "What do you see and hear?"}]}]


def test_thinker_text_equals_transformers(omni: Omni, omni25_hf) -> None:
    messages = chat()
    (out,) = omni.generate({"messages": messages}, greedy(), output_modalities={"text"})
    assert out.error is None, out.error
    inputs = omni.engine.processor(messages)
    assert out.prompt_token_ids == inputs.input_ids.tolist()
    with torch.no_grad():
        seq = omni25_hf.thinker.generate(**inputs.hf_kwargs(), use_audio_in_video=True,
                                         do_sample=False, max_new_tokens=THINKER_TOKENS)
    assert out.token_ids == seq[0, inputs.input_ids.shape[0]:].tolist()
    (alone,) = omni.generate({"messages": [{"role": "user", "content": [
        {**messages[0]["content"][0], "audio": None}, messages[0]["content"][1]]}]},
        greedy(), output_modalities={"text"})
    assert alone.token_ids != out.token_ids, "the track changes the answer"


def test_text_and_speech_equal_transformers(omni: Omni, omni25_hf) -> None:
    messages = chat(3.0, 6)
    (out,) = omni.generate({"messages": messages}, greedy())
    assert out.error is None, out.error
    media = {k: v for k, v in omni.engine.processor(messages).hf_kwargs().items()
             if k not in ("input_ids", "attention_mask")}
    media = {f"thinker_{k}" if k.startswith("pixel_values") else k: v for k, v in media.items()}
    input_ids = torch.tensor([out.prompt_token_ids])
    handle = mask_the_talker(omni25_hf.talker)
    try:
        torch.manual_seed(SEED)   # token2wav's noise: the first draw after it
        with torch.no_grad():
            seq, wav = omni25_hf.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                speaker="Chelsie", use_audio_in_video=True, **media, thinker_do_sample=False,
                thinker_max_new_tokens=THINKER_TOKENS, talker_do_sample=False,
                talker_max_new_tokens=TALKER_TOKENS, talker_eos_token_id=[CODEC_PAD, CODEC_EOS])
    finally:
        handle.remove()
    assert out.token_ids == seq[0, input_ids.shape[1]:].tolist()
    audio, expected = out.tensors["audio"], wav.reshape(-1)
    assert 0.1 < expected.abs().max() and audio.shape == expected.shape
    assert (audio - expected).abs().max() <= 1e-4
