"""GPU-only (skipped without CUDA): Qwen2.5-Omni (thinker -> talker -> token2wav, stage
processes) on CUDA against transformers' generate(return_audio=True) on CUDA, float32 with
TF32 off, on the tiny checkpoint, a text turn and one with an audio, an image and a video: the
same text, the waveform within 1e-3. What this catches
is placement (a tensor left on the CPU, token2wav's noise drawn on the wrong device), not
numerics, which the CPU golden tests (tests/models/qwen2_5_omni/) pin down."""

from __future__ import annotations

import math

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import Omni, SamplingParams

pytestmark = [pytest.mark.usefixtures("no_tf32"), pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHAT = [{"role": "user", "content": "Hello world, what is the weather today?"}]
SEED = 3


def media_chat() -> list[dict]:
    """An audio (0.8 s), an image and a 4-frame video in one turn: the encoders on CUDA."""
    rng = np.random.default_rng(0)
    wave = (0.3 * np.sin(np.arange(12800) / 16000 * 2 * np.pi * 330)).astype(np.float32)
    image = Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))
    frames = [Image.fromarray(rng.integers(0, 256, (32, 24, 3), dtype=np.uint8))
              for _ in range(4)]
    return [{"role": "user", "content": [
        {"type": "audio", "audio": (wave, 16000)}, {"type": "image", "image": image},
        {"type": "video", "video": frames}, {"type": "text", "text": "What is it?"}]}]


@pytest.mark.parametrize("media", [False, True], ids=["text", "media"])
def test_qwen2_5_omni_on_cuda_equals_transformers(tmp_path: Path, media: bool) -> None:
    import transformers

    from omnistage.testing.tiny_qwen2_5_omni import (
        CODEC_EOS,
        CODEC_PAD,
        build_tiny_qwen2_5_omni,
        mask_the_talker,
    )

    ckpt = build_tiny_qwen2_5_omni(tmp_path / "omni25")
    params = [SamplingParams(temperature=0.0, max_tokens=8),
              SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=30,
                             extra={"speaker": "Ethan"}), None]
    with Omni(str(ckpt), device="cuda", dtype="float32",
              stage_overrides=[f"token2wav.generation.options.seed={SEED}",
                               "token2wav.generation.options.chunk_blocks=0",    # whole
                               "token2wav.generation.options.dit_dtype=float32"]) as omni:
        chat = media_chat() if media else CHAT
        (out,) = omni.generate({"messages": chat}, params)
        inputs = omni.engine.processor(chat).hf_kwargs()
    assert out.error is None, out.error
    hf = transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(ckpt).cuda().eval()
    ids = torch.tensor([out.prompt_token_ids], device="cuda")
    # pixels to the thinker alone: transformers 5.24's generate() hands them to the talker too
    extra = {f"thinker_{k}" if k.startswith("pixel_values") else k: v.cuda()
             for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    handle = mask_the_talker(hf.talker)      # transformers 5.24 drops the talker's mask
    try:
        torch.manual_seed(SEED)              # token2wav's noise: the first CUDA draw after it
        with torch.no_grad():
            seq, wav = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   speaker="Ethan", thinker_do_sample=False,
                                   thinker_max_new_tokens=8, talker_do_sample=False,
                                   talker_max_new_tokens=30,
                                   talker_eos_token_id=[CODEC_PAD, CODEC_EOS], **extra)
    finally:
        handle.remove()
    assert out.token_ids == seq[0, ids.shape[1]:].tolist()
    audio, expected = out.tensors["audio"], wav.reshape(-1).cpu()
    assert audio.shape == expected.shape and expected.abs().max() > 0.1
    assert (audio - expected).abs().max() <= 1e-3


def test_streamed_token2wav_on_cuda_equals_cpu(tmp_path: Path) -> None:
    """The streamed token2wav (windows of three requests batched, the vocoder stream) on CUDA
    against the same on the CPU: its noise is drawn on the CPU either way, so the two agree
    up to float32 rounding; what this catches is a tensor on the wrong device. CUDA's default
    (`dit_dtype: auto`, the DiT in bfloat16) comes within its measured error of float32."""
    from omnistage.generation.token2wav import Token2WavGenerator, Token2WavOptions
    from omnistage.testing.tiny_qwen2_5_omni import build_tiny_qwen2_5_omni

    ckpt = build_tiny_qwen2_5_omni(tmp_path / "omni25")
    gen = torch.Generator().manual_seed(0)
    requests = [torch.randint(0, 64, (n,), generator=gen) for n in (40, 17, 29)]
    audio = {}
    for key, device, dtype in (("cpu", "cpu", "float32"), ("cuda", "cuda", "float32"),
                               ("cuda-auto", "cuda", "auto")):
        t2w = Token2WavGenerator.from_pretrained(ckpt, "", torch.device(device), None,
                                                 Token2WavOptions(dit_dtype=dtype))
        states: list[dict] = [{} for _ in requests]
        pieces: list[list[torch.Tensor]] = [[] for _ in requests]
        with torch.inference_mode():
            for call in range(200):
                inputs = [{"codes": c[call * 4:call * 4 + 4],
                           "speaker": torch.full_like(c[call * 4:call * 4 + 4], i % 2)}
                          if call * 4 < c.numel() else {} for i, c in enumerate(requests)]
                last = [(call + 1) * 4 >= c.numel() for c in requests]
                for p, out in zip(pieces, t2w.generate(inputs, states, last)):
                    if out:
                        p.append(out["audio"])
                if all(lst and not t2w.has_backlog(s) for lst, s in zip(last, states)):
                    break
        audio[key] = [torch.cat(p) for p in pieces]
    for cpu, cuda, auto in zip(audio["cpu"], audio["cuda"], audio["cuda-auto"]):
        assert cpu.shape == cuda.shape == auto.shape and cpu.abs().max() > 0.1
        assert (cpu - cuda).abs().max() <= 1e-3
        snr = 10 * math.log10(cpu.pow(2).sum() / (auto - cpu).pow(2).sum())
        assert 35 < snr < 200, snr                     # bfloat16: close, and not float32
