"""GPU-only (skipped without CUDA): CosyVoice3's flow stage options (generation/cosyvoice3.py,
issue 43) on CUDA. On the tiny checkpoint, float32 without TF32, two streamed requests at
different chunks in the same flow calls: `cuda_graphs` equals the eager path at the same padded
shapes (bit for bit expected; 1e-5 asserted) and the unpadded eager within 1e-4, at float32 and
at bfloat16; graphs + `flow_dtype: bfloat16` against eager float32 by SNR. At the released DiT's
shape (22 x 1024, random weights), one flow call's time printed: eager float32, eager bf16,
graphs bf16 (the option's case for turning on; bench speech measures it end to end).

    pytest -q -s -m gpu tests/gpu/test_cosyvoice3_flow_cuda.py
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from omnistage.diffusion.pipelines.cosyvoice3 import CloneInput, fixed_noise, token2mel
from omnistage.generation.cosyvoice3 import (CosyVoice3FlowOptions, CosyVoice3Generator,
                                              FlowGraphs)
from omnistage.models.cosyvoice3.config import DiTConfig, FlowConfig
from omnistage.models.cosyvoice3.flow import CausalMaskedDiffWithDiT
from omnistage.models.cosyvoice3.model import CosyVoice3
from omnistage.payloads import AudioChunk, Payload, TokenDelta, VoicePrompt
from tests.helpers.cosyvoice3 import FIXTURES, manifest, write_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")


def snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean()))


def _stream(g: CosyVoice3Generator, starts: list[int]) -> list[torch.Tensor]:
    """The fixtures' long request once per start step, fed one token a step together; each
    one's audio, its chunks joined."""
    ref = torch.load(FIXTURES / "stream.pt", map_location="cpu", weights_only=True)
    voice = VoicePrompt(ref["long.prompt_token"][0], ref["long.prompt_feat"][0],
                        ref["long.embedding"][0])
    feeds = [Payload(tokens=TokenDelta([t]), voice_prompt=voice if i == 0 else None).pack()
             for i, t in enumerate(ref["long.token"][0].tolist())]
    states: list[dict] = [{} for _ in starts]
    out: list[list[torch.Tensor]] = [[] for _ in starts]
    live = set(range(len(starts)))
    for step in range(1000):
        if not live:
            return [torch.cat(o) for o in out]
        rows = [r for r in sorted(live) if step >= starts[r]]
        xs = [feeds[step - starts[r]] if step - starts[r] < len(feeds) else {} for r in rows]
        last = [step - starts[r] >= len(feeds) - 1 for r in rows]
        for r, x, closed in zip(rows, g.generate(xs, [states[r] for r in rows], last), last):
            if x:
                out[r].append(AudioChunk.unpack(x).samples)
            if closed and not g.has_backlog(states[r]):
                live.discard(r)
    raise AssertionError("the streams did not end")


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_equal_eager_on_the_tiny_checkpoint(tmp_path: Path, dtype: str) -> None:
    folder = write_checkpoint(tmp_path / "cosyvoice3")
    s = manifest()["stream"]
    base = dict(token_hop_len=s["token_hop_len"], token_max_hop_len=s["token_max_hop_len"],
                noise_seed=s["noise_seed"])

    def generator(**kw: object) -> CosyVoice3Generator:     # float32 eager unless told
        opts = {**base, "flow_dtype": "float32", "cuda_graphs": False, **kw}
        return CosyVoice3Generator(CosyVoice3.from_pretrained(folder, CUDA), CUDA,
                                   CosyVoice3FlowOptions(**opts))  # type: ignore[arg-type]

    reference = _stream(generator(), [0, 8])                      # eager float32, unpadded
    eager = _stream(generator(flow_dtype=dtype), [0, 8])
    graphed_gen = generator(flow_dtype=dtype, cuda_graphs=True, graph_frames=16)
    assert graphed_gen.graphs is not None
    graphed = _stream(graphed_gen, [0, 8])
    padded_gen = generator(flow_dtype=dtype, graph_frames=16)
    padded_gen.use_graphs(capture_after=10 ** 9)                  # eager, the same shapes
    padded = _stream(padded_gen, [0, 8])
    assert graphed_gen.graphs.num_replays >= 4
    for g, p, e, r in zip(graphed, padded, eager, reference):
        assert r.abs().max() > 0.1 and g.shape == r.shape
        torch.testing.assert_close(g, p, atol=1e-5, rtol=0)
        if dtype == "float32":
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
        else:
            assert snr_db(g, e) > 20.0, snr_db(g, e)            # padding: other bf16 kernels
            assert snr_db(g, r) > 15.0, snr_db(g, r)            # the CPU test's bound
            print(f"\ncosyvoice3 graphs+bf16 vs eager float32: waveform {snr_db(g, r):.1f} dB")


def _released_flow() -> CausalMaskedDiffWithDiT:
    """The released flow's shape (DiT 22 x 1024, 16 heads of 64, chunks of 50 frames), random
    weights scaled down so that the activations stay finite."""
    dit = DiTConfig(dim=1024, depth=22, heads=16, dim_head=64, ff_mult=2, mel_dim=80,
                    mu_dim=80, spk_dim=80, static_chunk_size=50)
    cfg = FlowConfig(vocab_size=6561, input_size=80, output_size=80, spk_embed_dim=192,
                     token_mel_ratio=2, pre_lookahead_len=3, lookahead_channels=1024,
                     inference_cfg_rate=0.7, t_scheduler="cosine", dit=dit)
    flow = CausalMaskedDiffWithDiT(cfg)
    with torch.no_grad():
        for p in flow.parameters():
            p.mul_(0.5)
    return flow.to(CUDA).eval()


def test_flow_call_time_at_the_released_shape() -> None:
    """One streamed first chunk (a 3 s prompt: 75 tokens, then 25 + 3 look-ahead) and a
    batch of 8 such: eager float32 against eager bf16 and graphs bf16; graphs bf16 faster."""
    flow = _released_flow()
    noise = fixed_noise(80, CUDA)
    gen = torch.Generator().manual_seed(0)

    def clone() -> CloneInput:
        return CloneInput(torch.randint(0, 6561, (28,), generator=gen),
                          torch.randint(0, 6561, (75,), generator=gen),
                          torch.randn(150, 80, generator=gen), torch.randn(192, generator=gen),
                          streaming=True, finalize=False)

    times: dict[str, list[float]] = {}
    for rows in (1, 8):
        inputs = [clone() for _ in range(rows)]
        for name in ("eager float32", "eager bf16", "graphs bf16"):
            flow.estimator.compute_in(torch.float32 if "32" in name else torch.bfloat16)
            graphs = FlowGraphs(flow, 64, 4096) if "graphs" in name else None
            shapes = None if graphs is None else graphs.shapes
            for _ in range(3):
                token2mel(flow, inputs, noise, 10, shapes, graphs)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                token2mel(flow, inputs, noise, 10, shapes, graphs)
            torch.cuda.synchronize()
            times.setdefault(name, []).append((time.perf_counter() - start) / 5)
    for name, t in times.items():
        print(f"\ncosyvoice3 flow call at the released shape, {name}: "
              f"1 row {t[0] * 1e3:.1f} ms, 8 rows {t[1] * 1e3:.1f} ms")
    assert times["graphs bf16"][0] < times["eager float32"][0]
