"""GPU-only (skipped without CUDA): the vocoder's CUDA graphs (`VocoderGraphs`: the
pre-transformer continued and the convolutions, at every padded shape of a few streams) give
what the eager forwards at the same padded shapes give, float32, for streams at different
points: first chunks, later ones, a short final one, and a batch past the graphs' largest
(eager)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.models.qwen3_omni.code2wav import Code2Wav
from omnistage.models.qwen3_omni.code2wav_stream import (Code2WavStream, VocoderGraphs,
                                                         VocoderShapes, decode_streams)
from omnistage.testing.tiny_omni import build_tiny_qwen3_omni

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def no_tf32():
    matmul, conv = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, conv


def run(model: Code2Wav, codes: list[torch.Tensor], shapes: VocoderShapes,
        graphs: VocoderGraphs | None) -> list[torch.Tensor]:
    """Each stream fed 3, then 7, then 2 frames (as many as it has; decoding after each), and
    finished once it has none left."""
    ctx = model.cfg.receptive_field_frames
    streams = [Code2WavStream(model, 5, ctx, 3) for _ in codes]
    outs: list[list[torch.Tensor]] = [[] for _ in codes]
    start = 0
    for n in (3, 7, 2):
        for s, c in zip(streams, codes):
            if not s.is_finished:
                s.append(c[:, start:start + n])
                if start + n >= c.shape[1]:
                    s.finish()
        start += n
        while any(s.has_ready_chunk for s in streams):
            for o, new in zip(outs, decode_streams(streams, 400, shapes, graphs)):
                o.append(new)
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("lengths", [(12, 12, 12), (12, 12, 12, 4, 4, 4)],
                         ids=["graphed", "six-then-three"])
def test_graph_replays_equal_eager(tmp_path: Path, lengths: tuple[int, ...]) -> None:
    """Three streams: every forward replayed. Six: the first forwards (six streams, more than
    the graphs' four) eager, the rest (three left) replayed."""
    ckpt = build_tiny_qwen3_omni(tmp_path / "omni", with_processor=False)
    model = Code2Wav.from_pretrained(ckpt, "cuda", torch.float32).eval()
    ctx, q = model.cfg.receptive_field_frames, model.cfg.num_quantizers
    shapes = VocoderShapes.for_stream(3, 5, ctx, 400)
    graphs = VocoderGraphs(model, shapes, max_batch=4)
    assert len(graphs.transformer.graphs) == len([b for b, _ in shapes.all_new() if b <= 4])
    g = torch.Generator().manual_seed(len(lengths))
    codes = [torch.randint(0, model.cfg.codebook_size, (q, n), generator=g) for n in lengths]
    eager = run(model, codes, shapes, None)
    replays = graphs.transformer.num_replays, graphs.vocode.num_replays
    graphed = run(model, codes, shapes, graphs)
    assert graphs.transformer.num_replays > replays[0]
    assert graphs.vocode.num_replays > replays[1]
    for n, e, r in zip(lengths, eager, graphed):
        assert e.numel() == model.cfg.num_samples(n) and e.abs().max() > 1e-2
        torch.testing.assert_close(r, e, rtol=0, atol=1e-5)
