"""CUDA graphs of Qwen2.5-Omni's streamed token2wav: its two forwards, a whole RK4 step of
the windows' guided DiT and the vocoder's windows, replayed at a few padded shapes, all
captured at start-up, so that no request pays a capture.

Why: at the bench size (a DiT of 22 layers of 1024, a BigVGAN from 1536 channels) one RK4
step of the windows in flight is four evaluations of both guidance halves, about 22 x 4 x 20
small kernels whose launches, from Python, take longer than the GPU takes to run them (eager:
a real-time factor of 0.73 for one request alone on an H100, and the first audio after 1.2 s).

The shapes a stream plans (`plan_shapes`): a DiT window holds the first chunk with its right
context, or a chunk of each later size (chunks grow up to `chunk_blocks`) with context on both
sides (shorter ones, a stream's last, are padded up to one of these), rows 1, 2, 4, ... up to
what `max_batch_frames` lets in flight; a vocoder window holds the first chunk's mel, or a
later chunk's with the vocoder's context on both sides (bigvgan_stream.py says how a last
window fits them), rows 1, 2, 4, ... `max_vocoder_rows`.
"""

from __future__ import annotations

from functools import partial

import torch

from omnistage.generation.token2wav_stream import Chunking, dit_step
from omnistage.layers.graph_capture import PaddedShapes, ShapeGraphs
from omnistage.models.qwen2_5_omni.token2wav import Token2Wav


def plan_shapes(model: Token2Wav, chunking: Chunking, max_batch_frames: int,
                max_vocoder_rows: int = 8) -> tuple[PaddedShapes, PaddedShapes]:
    """-> (the DiT windows' shapes, the vocoder windows')."""
    c, block = chunking, model.cfg.dit.block_size
    first, later = c.first_chunk_blocks, {c.blocks_after(k) for k in c.sizes()}
    dit = PaddedShapes(tuple(sorted({(first + c.right_blocks) * block,
                                     *((c.left_blocks + k + c.right_blocks) * block
                                       for k in later)})), max_batch_frames)
    context = model.code2wav_bigvgan_model.context_frames
    lengths = tuple(sorted({first * block, *(2 * context + k * block for k in later)}))
    return dit, PaddedShapes(lengths, max_vocoder_rows * lengths[-1], max_vocoder_rows)


class Token2WavGraphs:
    """`dit`: `dit_step` (past its DiT and guidance scale) replayed at every planned shape of
    `dit_shapes`; `vocode`: `Token2Wav.vocode` at every shape of `mel_shapes`; every graph
    captured now, the largest first (the graphs of each share one memory pool); other shapes
    run eagerly."""

    def __init__(self, model: Token2Wav, times: torch.Tensor, guidance_scale: float,
                 dit_shapes: PaddedShapes, mel_shapes: PaddedShapes) -> None:
        cfg, dev = model.cfg.dit, times.device
        shapes, windows = (sorted(s.all(), key=lambda bn: -bn[0] * bn[1])
                           for s in (dit_shapes, mel_shapes))
        self.dit = ShapeGraphs(partial(dit_step, model.dit, guidance_scale),
                               max_graphs=len(shapes), capture_after=1)
        self.vocode = ShapeGraphs(model.vocode, max_graphs=len(windows), capture_after=1)
        with torch.inference_mode():
            for b, n in shapes:          # the arguments step_windows passes, in kind
                steps = torch.zeros(b, dtype=torch.long)
                speaker = torch.zeros(b, cfg.enc_dim, device=dev)
                self.dit(torch.zeros(b, n, cfg.mel_dim, device=dev), times[steps],
                         times[steps + 1], torch.zeros(b, cfg.enc_emb_dim, device=dev),
                         speaker, speaker.clone(),
                         torch.zeros(b, n // cfg.repeats, dtype=torch.long, device=dev),
                         torch.full((b,), n, device=dev))
            for b, n in windows:
                self.vocode(torch.zeros(b, n, cfg.mel_dim, device=dev))

    @property
    def num_graphs(self) -> int:
        return len(self.dit.graphs) + len(self.vocode.graphs)
