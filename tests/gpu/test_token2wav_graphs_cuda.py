"""GPU-only (skipped without CUDA): the streamed Qwen2.5-Omni token2wav with its CUDA graphs
(every DiT step and vocoder forward replayed at planned shapes, captured at start-up) against
its eager path on CUDA: on the tiny checkpoint, float32 without TF32, the same audio and no
capture after start-up; at the bench size (DiT 22 x 1024, BigVGAN from 1536 channels, random
weights tamed to working sizes), the same audio and a throughput print (the real-time factor
and the first audio at 1, 8 and 32 requests, every code in at once), graphs against eager,
this stage alone on the GPU (in the bench it shares it with the thinker and the talker).

    pytest -q -s -m gpu tests/gpu/test_token2wav_graphs_cuda.py
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from omnistage.generation.token2wav import Token2WavGenerator, Token2WavOptions
from omnistage.models.qwen2_5_omni.token2wav import Speaker, Token2Wav, Token2WavConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")


def run(gen: Token2WavGenerator, requests: list[tuple[torch.Tensor, int]], per_call: int
        ) -> tuple[list[torch.Tensor], list[float], float]:
    """Each request fed `per_call` codes a call, all in the same calls, until no backlog:
    (each one's audio, seconds to its first audio, seconds in all)."""
    states: list[dict] = [{} for _ in requests]
    pieces: list[list[torch.Tensor]] = [[] for _ in requests]
    first = [0.0] * len(requests)
    start = time.perf_counter()
    with torch.inference_mode():
        for call in range(100000):
            lo = call * per_call
            inputs = [{"codes": c[lo:lo + per_call], "speaker": torch.full_like(
                c[lo:lo + per_call], s)} if lo < c.numel() else {} for c, s in requests]
            last = [lo + per_call >= c.numel() for c, _ in requests]
            for i, out in enumerate(gen.generate(inputs, states, last)):
                if out:
                    first[i] = first[i] or time.perf_counter() - start
                    pieces[i].append(out["audio"])
            if all(last) and not any(gen.has_backlog(s) for s in states):
                break
    return [torch.cat(p) for p in pieces], first, time.perf_counter() - start


@pytest.mark.usefixtures("no_tf32")
def test_graphs_equal_eager_on_cuda(tmp_path: Path) -> None:
    """Three requests (two speakers, 40, 17 and 29 codes, 4 a call) streamed with graphs and
    without: the same audio; every shape was captured at start-up."""
    from omnistage.testing.tiny_qwen2_5_omni import build_tiny_qwen2_5_omni

    ckpt = build_tiny_qwen2_5_omni(tmp_path / "omni25")
    # float32: the graphs against eager at float32 rounding (the bf16 default: bench omni25)
    eager = Token2WavGenerator.from_pretrained(ckpt, "", CUDA, None, Token2WavOptions(
        cuda_graphs=False, dit_dtype="float32"))
    graphed = Token2WavGenerator.from_pretrained(ckpt, "", CUDA, None,
                                                 Token2WavOptions(dit_dtype="float32"))
    assert eager.graphs is None and graphed.graphs is not None
    graphs = graphed.graphs
    captured, replays = graphs.num_graphs, graphs.dit.num_replays
    assert captured == len(graphed.dit_shapes.all()) + len(graphed.mel_shapes.all())
    g = torch.Generator().manual_seed(0)
    requests = [(torch.randint(0, 64, (n,), generator=g), i % 2)
                for i, n in enumerate((40, 17, 29))]
    expected, _, _ = run(eager, requests, 4)
    got, _, _ = run(graphed, requests, 4)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and b.abs().max() > 0.1
        assert (a - b).abs().max() <= 1e-4
    assert graphs.num_graphs == captured and graphs.dit.num_replays > replays + 9


@torch.no_grad()
def bench_token2wav() -> tuple[Token2Wav, list[Speaker]]:
    """The bench's token2wav (benchmarks/omni25.py BENCH_SIZES) with random weights on CUDA,
    its speaker vector, time embedding, velocity and waveform rescaled to unit spread (a
    peak of 0.5 for the waveform), as the trained model's are; one speaker."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
        Qwen2_5OmniToken2WavConfig,
    )

    from omnistage.benchmarks.omni25 import BENCH_SIZES

    hf = Qwen2_5OmniToken2WavConfig(dit_config=BENCH_SIZES["dit"],
                                    bigvgan_config=BENCH_SIZES["bigvgan"])
    torch.manual_seed(0)
    with torch.device(CUDA):
        model = Token2Wav(Token2WavConfig(dit=hf.dit_config, bigvgan=hf.bigvgan_config)).eval()
        cfg = model.cfg.dit
        speaker = Speaker(0, torch.randn(1, cfg.enc_emb_dim), torch.randn(1, 100, cfg.mel_dim))
        dit = model.dit
        dit.input_embed.spk_encoder.fc.weight.div_(dit.encode_speaker(speaker.ref_mel).std())
        dit.input_embed.spk_encoder.fc.bias.zero_()
        temb = dit.time_embed(torch.rand(8))
        dit.time_embed.time_mlp[2].weight.div_(temb.std())
        dit.time_embed.time_mlp[2].bias.zero_()
        x, codes = torch.randn(1, 48, cfg.mel_dim), torch.randint(0, 4000, (1, 24))
        v = dit(x, torch.full((1,), 0.5), speaker.cond, dit.encode_speaker(speaker.ref_mel),
                codes)
        dit.proj_out.weight.div_(v.std())
        dit.proj_out.bias.zero_()
        wav = model.vocode(torch.randn(1, 48, cfg.mel_dim) - 5)
        model.code2wav_bigvgan_model.conv_post.weight.mul_(0.5 / wav.abs().max())
    return model, [Speaker(0, speaker.cond.cpu(), speaker.ref_mel.cpu())]


@pytest.mark.usefixtures("no_tf32")
def test_throughput_at_bench_size() -> None:
    """Prints, per concurrency: the real-time factor (seconds per second of each request's
    audio, every code in at once) and the first audio, eager and from graphs; their audio
    agrees. Without TF32 (float32 matmuls are so by PyTorch's default; cuDNN's TF32
    convolutions, on by default, would pick per shape and round differently: the vocoder is
    a small part of the time)."""
    model, speakers = bench_token2wav()
    g = torch.Generator().manual_seed(1)
    num_codes = 200                                   # 4 s of audio a request
    seconds = num_codes * model.cfg.samples_per_code / model.cfg.sample_rate
    start = time.perf_counter()
    graphed = Token2WavGenerator(model, speakers, Token2WavOptions(dit_dtype="float32"))
    torch.cuda.synchronize()
    print(f"\ntoken2wav graphs: {graphed.graphs.num_graphs} captured in "
          f"{time.perf_counter() - start:.1f} s; DiT {graphed.dit_shapes.all()}, "
          f"vocoder {graphed.mel_shapes.all()}")
    eager = Token2WavGenerator(model, speakers, Token2WavOptions(cuda_graphs=False,
                                                                 dit_dtype="float32"))
    for n in (1, 8, 32):
        requests = [(torch.randint(0, 4000, (num_codes,), generator=g), 0) for _ in range(n)]
        audio = {}
        for name, gen in (("eager", eager), ("graphs", graphed)):
            run(gen, requests[:1], num_codes)         # warm (cuDNN plans, allocator)
            audio[name], first, wall = run(gen, requests, num_codes)
            print(f"token2wav {name:6s} x{n:2d}: RTF {wall / seconds:.3f}, first audio "
                  f"{min(first):.3f} s (mean {sum(first) / n:.3f} s), all {wall:.2f} s")
        for a, b in zip(audio["graphs"], audio["eager"]):
            assert a.shape == b.shape and torch.isfinite(b).all() and b.abs().max() > 1e-3
            assert (a - b).abs().max() <= 2e-3, (a - b).abs().max()
