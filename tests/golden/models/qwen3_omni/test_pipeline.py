"""Qwen3-Omni end to end on the stage runtime (thinker -> talker -> code2wav) against
transformers' `generate(return_audio=True)` on a tiny random checkpoint, float32, greedy in
every stage: the same text tokens and the same waveform; chunked audio streaming; audio and
image inputs; text-only requests that never enter the talker; bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import AsyncOmni, Omni, SamplingParams
from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.processing import InputProcessor
from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

transformers = pytest.importorskip("transformers")

THINKER_TOKENS = 12
TALKER_TOKENS = 40
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello world, what is the weather today?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("omni"))


@pytest.fixture(scope="module")
def hf(ckpt: Path):
    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt).eval()
    # transformers 5.24: the talker's rope index reads `config.audio_config.n_window`, which
    # only the thinker's config has, so audio input with audio output crashes there; lend it
    model.talker.config.audio_config = model.config.thinker_config.audio_config
    return model


@pytest.fixture(scope="module")
def processor(ckpt: Path) -> InputProcessor:
    return InputProcessor.from_pretrained(ckpt)


def greedy(thinker_tokens: int = THINKER_TOKENS, talker_tokens: int = TALKER_TOKENS,
           speaker: str | None = None) -> list:
    talker = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=talker_tokens,
                            extra={"speaker": speaker} if speaker else {})
    return [SamplingParams(temperature=0.0, max_tokens=thinker_tokens), talker, None]


def reference(hf, processor: InputProcessor, prompt: dict, capture: dict | None = None
              ) -> tuple[list[int], torch.Tensor]:
    """HF generate(return_audio=True), greedy; `capture` receives the talker's codes."""
    inputs = processor.parse_request(prompt).hf_kwargs()
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    decode = hf.code2wav.chunked_decode

    def spy(codes: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if capture is not None:
            capture["codes"] = codes.clone()
        return decode(codes, *args, **kwargs)

    hf.code2wav.chunked_decode = spy
    try:
        with torch.no_grad():
            seq, wav = hf.generate(**inputs, return_audio=True, thinker_do_sample=False,
                                   thinker_max_new_tokens=THINKER_TOKENS,
                                   thinker_eos_token_id=eos, talker_do_sample=False,
                                   talker_max_new_tokens=TALKER_TOKENS)
    finally:
        hf.code2wav.chunked_decode = decode
    return seq[0, inputs["input_ids"].shape[1]:].tolist(), wav.reshape(-1)


@pytest.fixture(scope="module")
def omni(ckpt: Path):
    # one code2wav chunk of 300 frames with 25 of context: what the reference decodes with
    with Omni(str(ckpt), device="cpu", backend="inproc", connector="inproc",
              stage_overrides=["code2wav.generation.options.chunk_frames=300",
                                "code2wav.generation.options.first_chunk_frames=300"]) as engine:
        yield engine


def test_text_and_audio_equal_transformers(omni: Omni, hf, processor: InputProcessor) -> None:
    expected_ids, expected_wav = reference(hf, processor, {"messages": CHAT})
    (out,) = omni.generate({"messages": CHAT}, greedy())
    assert out.error is None, out.error
    assert out.token_ids == expected_ids
    audio = out.tensors["audio"]
    assert audio.dtype == torch.float32 and audio.shape == expected_wav.shape
    assert (audio - expected_wav).abs().max() <= 1e-4
    assert audio.abs().max() > 0.01, "the tiny model should say something"
    assert out.text == processor.tokenizer.decode(expected_ids, skip_special_tokens=True)


def test_two_requests_together_equal_alone(omni: Omni) -> None:
    other = [{"role": "user", "content": "Please write a short poem about the ocean."}]
    (alone,) = omni.generate({"messages": CHAT}, greedy())
    both = omni.generate([{"messages": other}, {"messages": CHAT}], greedy())
    assert both[1].token_ids == alone.token_ids
    a, b = both[1].tensors["audio"], alone.tensors["audio"]
    assert a.shape == b.shape and (a - b).abs().max() <= 1e-4   # batched float sums differ
    assert both[0].token_ids != alone.token_ids


def test_text_only_request_skips_talker_and_code2wav(omni: Omni, hf,
                                                     processor: InputProcessor) -> None:
    expected_ids, _ = reference(hf, processor, {"messages": CHAT})
    (out,) = omni.generate({"messages": CHAT}, greedy(), output_modalities={"text"})
    assert out.token_ids == expected_ids and "audio" not in out.tensors
    assert set(out.stage_metrics) == {"thinker"}


def test_audio_and_image_inputs_equal_transformers(omni: Omni, hf,
                                                    processor: InputProcessor) -> None:
    rng = np.random.default_rng(0)
    wave = (0.3 * np.sin(np.arange(24000) / 16000 * 2 * np.pi * 440)
            + 0.05 * rng.standard_normal(24000)).astype(np.float32)     # 1.5 s at 16 kHz
    image = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
    chat = [{"role": "user", "content": [
        {"type": "audio", "audio": (wave, 16000)},
        {"type": "image", "image": image},
        {"type": "text", "text": "What do you hear and see?"}]}]
    expected_ids, expected_wav = reference(hf, processor, {"messages": chat})
    (out,) = omni.generate({"messages": chat}, greedy())
    assert out.error is None, out.error
    assert out.token_ids == expected_ids
    assert out.tensors["audio"].shape == expected_wav.shape
    assert (out.tensors["audio"] - expected_wav).abs().max() <= 1e-4


def test_second_turn_from_the_prefix_cache_equals_transformers(
        omni: Omni, hf, processor: InputProcessor) -> None:
    """A conversation's next turn (both user turns spoken) reuses the first turn's prefix
    blocks, its audio too, and the thinker's kept hidden rows feed the talker in place of
    recomputing them: the same text and waveform as transformers computing it all."""
    from omnistage.testing.speech_like import speech_like

    def spoken(seed: int, text: str) -> dict:
        return {"role": "user", "content": [{"type": "audio", "audio": (speech_like(
            0.8, seed=seed), 16000)}, {"type": "text", "text": text}]}

    first = [CHAT[0], spoken(1, "What did I say?")]
    (out1,) = omni.generate({"messages": first}, greedy())
    second = [*first, {"role": "assistant", "content": out1.text}, spoken(2, "And now?")]
    expected_ids, expected_wav = reference(hf, processor, {"messages": second})
    (out,) = omni.generate({"messages": second}, greedy())
    assert out.error is None, out.error
    assert out.stage_metrics["thinker"].num_cached_tokens >= 32     # the first turn's blocks
    assert out.token_ids == expected_ids
    assert out.tensors["audio"].shape == expected_wav.shape
    assert (out.tensors["audio"] - expected_wav).abs().max() <= 1e-4
    assert expected_wav.abs().max() > 0.01


def stream(ckpt: Path, params: list, chunk_frames: int, left_context: int,
           first_chunk_frames: int | None = None) -> list:
    engine = AsyncOmni(str(ckpt), device="cpu", backend="inproc", connector="inproc",
                       stage_overrides=[f"code2wav.generation.options.chunk_frames={chunk_frames}",
                                        "code2wav.generation.options.first_chunk_frames="
                                        f"{first_chunk_frames or chunk_frames}",
                                        f"code2wav.generation.options.left_context={left_context}"])
    try:
        async def run() -> list:
            return [o async for o in engine.generate({"messages": CHAT}, params)]

        return asyncio.run(run())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("first,chunk", [(1, 5), (7, 25)])
def test_audio_streams_in_chunks(ckpt: Path, hf, processor: InputProcessor, first: int,
                                 chunk: int) -> None:
    """Small code2wav chunks: audio arrives in several deltas which, concatenated, are the
    reference's waveform (its talker's ~39 frames decoded whole), seams and all."""
    _, expected = reference(hf, processor, {"messages": CHAT})
    ctx = Code2Wav.from_pretrained(ckpt).cfg.receptive_field_frames
    outs = stream(ckpt, greedy(), chunk_frames=chunk, left_context=ctx,
                  first_chunk_frames=first)
    deltas = [o.delta_tensors["audio"] for o in outs if "audio" in o.delta_tensors]
    assert len(deltas) >= 2        # several deltas (a step may carry several chunks)
    streamed = torch.cat(deltas)
    assert streamed.shape == expected.shape
    assert (streamed - expected).abs().max() <= 1e-4
    assert expected.abs().max() > 0.1   # audible: a seam would show


def test_first_audio_does_not_wait_for_the_text(ckpt: Path) -> None:
    """The talker follows the thinker token by token: with a long answer, the first audio
    chunk reaches the caller while the thinker is still writing."""
    thinker = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    talker = SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=200)
    outs = stream(ckpt, [thinker, talker, None], chunk_frames=1, left_context=2)
    first_audio = next(i for i, o in enumerate(outs) if "audio" in o.delta_tensors)
    last_text = max(i for i, o in enumerate(outs) if o.delta_token_ids)
    assert len(outs[-1].token_ids) == 120
    assert first_audio < last_text, "the first audio chunk waited for the whole text"


def test_bad_requests_fail_alone(omni: Omni) -> None:
    with pytest.raises(ValueError, match="no stage produces image"):
        omni.generate({"messages": CHAT}, greedy(), output_modalities={"image"})
    bad_audio = [{"role": "user", "content": [{"type": "audio", "audio": b"not a wav file"}]}]
    with pytest.raises(ValueError, match="audio"):
        omni.generate({"messages": bad_audio}, greedy())
    big = io.BytesIO()
    Image.new("RGB", (7000, 5000)).save(big, format="PNG")
    huge = [{"role": "user", "content": [{"type": "image", "image": big.getvalue()}]}]
    with pytest.raises(ValueError, match="too large"):
        omni.generate({"messages": huge}, greedy())
    with pytest.raises(ValueError, match="speaker 'nobody' is unknown"):   # at the front door
        omni.generate({"messages": CHAT}, greedy(speaker="nobody"))
    (after,) = omni.generate({"messages": CHAT}, greedy(speaker="Chelsie"))
    assert after.error is None and after.tensors["audio"].numel() > 0
    # `voice` is the same key as `speaker` (Qwen3-TTS's and OpenAI's word); other keys of the
    # talker's extra are refused, not ignored
    thinker, talker, code2wav = greedy()
    voiced = dataclasses.replace(talker, extra={"voice": "chelsie"})
    (same,) = omni.generate({"messages": CHAT}, [thinker, voiced, code2wav])
    assert torch.equal(same.tensors["audio"], after.tensors["audio"])
    with pytest.raises(ValueError, match="speaker 'nobody' is unknown"):
        omni.generate({"messages": CHAT}, [thinker, dataclasses.replace(
            talker, extra={"voice": "nobody"}), code2wav])
    (typo,) = omni.generate({"messages": CHAT}, [thinker, dataclasses.replace(
        talker, extra={"speakr": "chelsie"}), code2wav])
    assert typo.error is not None and "unknown keys ['speakr']" in str(typo.error), typo.error


def test_default_graph_with_stage_processes(ckpt: Path, hf, processor: InputProcessor) -> None:
    """The shipped graph as is (each stage a process, shm between them): image features and
    hidden states cross process boundaries; the same text and audio as the reference."""
    rng = np.random.default_rng(1)
    image = Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
    chat = [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": "Describe it."}]}]
    expected_ids, expected_wav = reference(hf, processor, {"messages": chat})
    with Omni(str(ckpt), device="cpu",
              # the talker's one option (CUDA only: no effect here); code2wav as shipped:
              # a 12-frame first chunk, then 25-frame ones with 25 frames of context
              stage_overrides=["talker.ar.options.code_predictor_cuda_graphs=false"]) as engine:
        (out,) = engine.generate({"messages": chat}, greedy())
    assert out.error is None, out.error
    assert out.token_ids == expected_ids
    assert expected_wav.numel() > 13 * 1920    # several chunks: seams inside
    assert out.audio.shape == expected_wav.shape
    assert (out.tensors["audio"] - expected_wav).abs().max() <= 1e-4
