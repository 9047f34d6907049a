"""Qwen2.5-Omni end to end on the stage runtime (thinker -> talker -> token2wav) against
transformers' `generate(return_audio=True)` on a tiny random checkpoint, float32, greedy in
the AR stages and the same noise seed in token2wav: the same text and the same waveform
(token2wav decoding whole); streamed audio (the default graph) arriving in deltas before the
request ends, within the measured seam error of the whole decode; text-only requests that
never enter the talker; speakers; bad input."""

from __future__ import annotations

import asyncio
import base64
import io
import math
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from omnistage import AsyncOmni, Omni, SamplingParams
from omnistage.entrypoints.openai.api_server import ServerConfig, build_app
from omnistage.testing.tiny_qwen2_5_omni import (CODEC_EOS, CODEC_PAD, SEAM_MIN_SNR_DB,
                                                  SEAM_TOLERANCE, mask_the_talker)

THINKER_TOKENS = 8
TALKER_TOKENS = 30
SEED = 3
CHAT = [{"role": "user", "content": "Hello world, what is the weather today?"}]


@pytest.fixture(scope="module")
def omni(omni25_path: Path):
    with Omni(str(omni25_path), device="cpu", backend="inproc", connector="inproc",
              stage_overrides=[f"token2wav.generation.options.seed={SEED}", "token2wav.generation.options.chunk_blocks=0",
                               f"talker.ar.sampling.max_tokens={TALKER_TOKENS}"]) as engine:
        yield engine


def greedy(speaker: str | None = None) -> list:
    talker = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=TALKER_TOKENS,
                            extra={"speaker": speaker} if speaker else {})
    return [SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS), talker, None]


def reference(hf, ids: list[int], speaker: str, **media: torch.Tensor
              ) -> tuple[list[int], torch.Tensor]:
    """`media`: the processor's other inputs as transformers takes them (hf_kwargs). Pixels go
    to the thinker alone: transformers 5.24's generate() hands them to the talker too, whose
    generate() refuses them."""
    media = {f"thinker_{k}" if k.startswith("pixel_values") else k: v for k, v in media.items()}
    input_ids = torch.tensor([ids])
    handle = mask_the_talker(hf.talker)
    try:
        torch.manual_seed(SEED)   # token2wav's noise: the first draw after it
        with torch.no_grad():
            seq, wav = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                   speaker=speaker, **media, thinker_do_sample=False,
                                   thinker_max_new_tokens=THINKER_TOKENS, talker_do_sample=False,
                                   talker_max_new_tokens=TALKER_TOKENS,
                                   talker_eos_token_id=[CODEC_PAD, CODEC_EOS])
    finally:
        handle.remove()
    return seq[0, len(ids):].tolist(), wav.reshape(-1)


@pytest.mark.parametrize("speaker", ["Ethan"])
def test_text_and_audio_equal_transformers(omni: Omni, omni25_hf, speaker: str) -> None:
    (out,) = omni.generate({"messages": CHAT}, greedy(speaker))
    assert out.error is None, out.error
    expected_ids, expected_wav = reference(omni25_hf, out.prompt_token_ids, speaker)
    assert out.token_ids == expected_ids
    audio = out.tensors["audio"]
    assert 0.1 < expected_wav.abs().max() < 0.99, "audible, not clamped"
    assert audio.shape == expected_wav.shape
    assert (audio - expected_wav).abs().max() <= 1e-4


def test_batched_and_prefix_cached_requests_equal_alone(omni: Omni) -> None:
    """Two requests at once (the talker and token2wav batch them), the second a prefix-cache
    hit on the first's prompt: each equals the same request alone."""
    other = [{"role": "user", "content": "Please write a short poem about the ocean."}]
    (alone,) = omni.generate({"messages": CHAT}, greedy("Ethan"))
    both = omni.generate([{"messages": other}, {"messages": CHAT}], greedy("Ethan"))
    assert both[1].token_ids == alone.token_ids and both[0].token_ids != alone.token_ids
    a, b = both[1].tensors["audio"], alone.tensors["audio"]
    assert a.shape == b.shape and (a - b).abs().max() <= 1e-4


def test_streamed_audio_arrives_early_and_close_to_whole(omni25_path: Path, omni: Omni) -> None:
    """The shipped graph streams token2wav: audio deltas reach the caller before the request
    ends (that they come while the talker still writes, on the CPU's pace here a race with
    the tiny talker, is test_token2wav_stream's), and together they are the whole decode
    within the seam error scripts/measure_token2wav_seams.py measured (SEAM_TOLERANCE,
    SEAM_MIN_SNR_DB)."""
    params = greedy("Ethan")
    params[1] = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=90,
                               ignore_eos=True, extra={"speaker": "Ethan"})
    (whole,) = omni.generate({"messages": CHAT}, params)
    engine = AsyncOmni(str(omni25_path), device="cpu", backend="inproc", connector="inproc",
                       stage_overrides=[f"token2wav.generation.options.seed={SEED}"])
    try:
        async def run() -> list:
            return [o async for o in engine.generate({"messages": CHAT}, params)]

        outs = asyncio.run(asyncio.wait_for(run(), timeout=120))
    finally:
        engine.shutdown()
    deltas = [(o.finished, o.delta_tensors["audio"]) for o in outs if "audio" in o.delta_tensors]
    assert len(deltas) >= 3 and not deltas[0][0], "audio in pieces, before the request's end"
    audio, expected = torch.cat([d for _, d in deltas]), whole.tensors["audio"]
    assert audio.shape == expected.shape and expected.abs().max() > 0.1
    err = audio - expected
    snr = 10 * math.log10(expected.pow(2).sum() / err.pow(2).sum())
    assert err.abs().max() <= SEAM_TOLERANCE and snr >= SEAM_MIN_SNR_DB, (err.abs().max(), snr)


def test_text_only_request_skips_talker(omni: Omni) -> None:
    (out,) = omni.generate({"messages": CHAT}, greedy(), output_modalities={"text"})
    (both,) = omni.generate({"messages": CHAT}, greedy())
    assert out.token_ids == both.token_ids and "audio" not in out.tensors
    assert set(out.stage_metrics) == {"thinker"}
    assert both.tensors["audio"].numel() > 0


def media_chats() -> list[list[dict]]:
    """A turn with an audio (0.8 s), one with an image, one with a 4-frame video, one text."""
    rng = np.random.default_rng(0)
    wave = (0.3 * np.sin(np.arange(12800) / 16000 * 2 * np.pi * 330)
            + 0.05 * rng.standard_normal(12800)).astype(np.float32)
    image = Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))
    frames = [Image.fromarray(rng.integers(0, 256, (32, 24, 3), dtype=np.uint8))
              for _ in range(4)]
    parts = [{"type": "audio", "audio": (wave, 16000)}, {"type": "image", "image": image},
             {"type": "video", "video": frames}]
    return [[{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]
            for part in parts] + [CHAT]


def test_media_requests_batched_equal_transformers(omni: Omni, omni25_hf) -> None:
    """Audio, image, video and text-only requests in one batch: each one's prompt is the
    processor's and its greedy text equals transformers' thinker on that request alone."""
    chats = media_chats()
    outs = omni.generate([{"messages": c} for c in chats], greedy(), output_modalities={"text"})
    for i, (chat, out) in enumerate(zip(chats, outs)):
        assert out.error is None, out.error
        inputs = omni.engine.processor(chat)
        assert out.prompt_token_ids == inputs.input_ids.tolist(), f"request {i}"
        with torch.no_grad():
            seq = omni25_hf.thinker.generate(**inputs.hf_kwargs(), do_sample=False,
                                             max_new_tokens=THINKER_TOKENS)
        assert out.token_ids == seq[0, inputs.input_ids.shape[0]:].tolist(), f"request {i}"
    assert len({tuple(o.token_ids) for o in outs}) == len(outs), "the media change the answer"


@pytest.mark.parametrize("kind", [0, 2], ids=["audio", "video"])
def test_media_input_speaks_as_transformers(omni: Omni, omni25_hf, kind: int) -> None:
    """An audio (a video) part through the whole graph: text and waveform as
    `generate(return_audio=True)`; the talker speaks from the media rows' hidden states alone
    and, for the video, continues the thinker's 3-D positions."""
    chat = media_chats()[kind]
    (out,) = omni.generate({"messages": chat}, greedy("Chelsie"))
    assert out.error is None, out.error
    media = omni.engine.processor(chat).hf_kwargs()
    expected_ids, expected_wav = reference(omni25_hf, out.prompt_token_ids, "Chelsie",
                                           **{k: v for k, v in media.items()
                                              if k not in ("input_ids", "attention_mask")})
    assert out.token_ids == expected_ids
    audio = out.tensors["audio"]
    assert 0.1 < expected_wav.abs().max() and audio.shape == expected_wav.shape
    assert (audio - expected_wav).abs().max() <= 1e-4


def test_unknown_speaker_is_refused_before_any_stage(omni: Omni) -> None:
    with pytest.raises(ValueError, match="speaker 'nobody' is unknown.*chelsie, ethan"):
        omni.generate({"messages": CHAT}, greedy("nobody"))


def chat(omni: Omni, body: dict) -> httpx.Response:
    """One /v1/chat/completions call to the server's app over this engine, in process."""
    async def go() -> httpx.Response:
        app = build_app(omni.engine, ServerConfig(served_model_name="omni25"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json=body, timeout=60)

    return asyncio.run(go())


def test_server_speaks_and_refuses_bad_input(omni: Omni) -> None:
    body = {"model": "omni25", "messages": CHAT, "max_tokens": 4,
            "modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}
    ok = chat(omni, body)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["audio"]["data"]
    unknown = chat(omni, {**body, "audio": {"voice": "nobody", "format": "wav"}})
    assert unknown.status_code == 400, unknown.text
    assert unknown.json()["error"]["param"] == "audio.voice"
    assert "chelsie, ethan" in unknown.json()["error"]["message"]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    media = chat(omni, {**body, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, image]}]})
    assert media.status_code == 400, media.text
    assert "image" in media.json()["error"]["message"]
    wav = io.BytesIO()
    soundfile.write(wav, media_chats()[0][0]["content"][0]["audio"][0], 16000, format="WAV")
    sound = {"type": "input_audio",
             "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"}}
    text_only = {k: v for k, v in body.items() if k != "audio"}
    heard = chat(omni, {**text_only, "modalities": ["text"], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, sound]}]})
    assert heard.status_code == 200, heard.text
    assert heard.json()["usage"]["prompt_tokens"] > 20          # the audio's placeholders
