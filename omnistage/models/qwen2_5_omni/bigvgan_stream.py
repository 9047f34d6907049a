"""Streaming BigVGAN: mel frames in any pieces, the waveform out as soon as it is final, and
the concatenation equal to the whole decode `vocoder(all mel)` within float32 rounding.

BigVGAN is convolutional and not causal: a sample depends on `context_frames` mel frames on
either side of its own (34 for the released vocoder; bigvgan.py says how it is bounded). So
a stream returns the samples of a frame once `context_frames` later frames are in, and
decodes each window with `context_frames` frames before the first frame it returns:

    mel frames    | 0 ........................... n1 | ........................ n2 |
    window 1      [0 ............................ n1)             returns frames [0, n1 - C)
    window 2                         [n1 - 2C ........................... n2)
                                         returns frames [n1 - C, n2 - C)
    last window   (input closed)          [n2 - 2C ........................ end)
                                         returns frames [n2 - C, end), to the last sample

Every returned sample sees real mel wherever the whole decode's does; a window's own edges
(zero and replicate padding) reach only samples it does not return, except at frame 0 and at
the last frame, which are the whole decode's edges too. Windows of several streams share one
forward, right-padded (the padding is out of reach of every returned sample); a stream's last
window runs unpadded, since its right edge is the decode's.

With planned shapes (`PaddedShapes`, on CUDA: every forward replayed from a CUDA graph), a
window holds at most the longest planned length (frames past it wait for the next call), is
right-padded to a planned length and its batch to a planned number of rows; a last window,
which cannot be padded on the right, takes more frames of real mel on the left instead, up to
a planned length (the stream keeps that many), which changes none of its returned samples.
Only a stream shorter than that (its whole mel in one window, both edges the decode's) runs
at its own length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from omnistage.layers.graph_capture import PaddedShapes, stack_padded
from omnistage.models.qwen2_5_omni.bigvgan import BigVGAN

MelWindow = tuple[int, Tensor, int, int, bool]   # stream, mel (W, mel), skip, samples, last


class MelStream:
    """One request's vocoder stream: `append` mel (n, mel), `finish`, and `vocode_streams`
    returns the new samples (float32, 1-D) of many streams at once. shapes: the planned
    window lengths (None: windows of any length)."""

    def __init__(self, vocoder: BigVGAN, mel_dim: int, device: torch.device,
                 shapes: PaddedShapes | None = None) -> None:
        self.vocoder = vocoder
        self.context = vocoder.context_frames
        self.longest = shapes.lengths[-1] if shapes is not None else 0
        assert shapes is None or self.longest > 2 * self.context, \
            f"planned windows {shapes.lengths} too short for {self.context} frames a side"
        self.shapes = shapes
        self._mel = torch.empty(0, mel_dim, device=device)   # frames [_first, num_frames)
        self._first = 0
        self.num_frames = 0            # mel frames received
        self.num_done = 0              # frames whose samples were returned
        self.is_finished = False

    def append(self, mel: Tensor) -> None:
        assert not self.is_finished, "mel after the stream's end"
        self._mel = torch.cat([self._mel, mel.to(self._mel)])   # replaced, not grown in place
        self.num_frames += mel.shape[0]

    def finish(self) -> None:
        self.is_finished = True

    @property
    def num_ready(self) -> int:
        """Frames whose samples are final now: all but the last `context` (all, once the
        input is closed)."""
        end = self.num_frames if self.is_finished else self.num_frames - self.context
        return max(0, end - self.num_done)

    def take_window(self) -> tuple[Tensor, int, int, bool]:
        """The next window: (mel (W, mel), samples to skip, samples to return, whether it is
        the last); the stream moves past it and keeps the frames a later one may need."""
        n = self.num_ready
        assert n > 0, "no frame is ready"
        start = max(0, self.num_done - self.context)
        end, last = self.num_frames, self.is_finished
        if self.shapes is not None and end - start > self.longest:    # as much as fits
            n = self.longest - (self.num_done - start) - self.context
            end, last = self.num_done + n + self.context, False
        elif self.shapes is not None and last:        # more real mel on the left, not padding
            start = max(0, end - self.shapes.length(end - start))
        window = self._mel[start - self._first:end - self._first]
        skip = (self.num_done - start) * self.vocoder.hop
        self.num_done += n
        keep = max(0, min(self.num_done - self.context, self.num_frames - self.longest))
        self._mel, self._first = self._mel[keep - self._first:], keep
        return window, skip, n * self.vocoder.hop, last


@torch.inference_mode()
def vocode_streams(streams: Sequence[MelStream], shapes: PaddedShapes | None = None,
                   vocode: Callable[[Tensor], Tensor] | None = None) -> list[Tensor]:
    """The new samples of each stream (float32, 1-D, maybe empty): the ready windows of the
    streams still open in one right-padded forward, each last window alone; with `shapes`
    (the streams'), forwards at planned shapes. vocode: what runs mel (B, T, mel) ->
    (B, samples) (CUDA graphs of the vocoder; default: it, eagerly)."""
    out = [torch.empty(0)] * len(streams)
    windows = [(i, *s.take_window()) for i, s in enumerate(streams) if s.num_ready]
    if not windows:
        return out
    vocoder = streams[0].vocoder
    run = vocode or (lambda mel: vocoder(mel.transpose(1, 2)))
    for batch, rows, length in _batches(windows, shapes):
        wav = run(stack_padded([mel for _, mel, *_ in batch], rows, length))   # (B, samples)
        for row, (i, _, skip, n, _) in enumerate(batch):
            out[i] = wav[row, skip:skip + n].float()
    return out


def _batches(windows: list[MelWindow], shapes: PaddedShapes | None
             ) -> list[tuple[list[MelWindow], int, int]]:
    """(windows, rows, frames) of each forward: open windows right-padded, last ones at their
    own length; without shapes, the open ones in one forward and each last one alone; with
    them, windows of one padded length together, at most the planned rows a forward."""
    if shapes is None:
        open_ = [w for w in windows if not w[4]]
        batches = [(open_, len(open_), max(w[1].shape[0] for w in open_))] if open_ else []
        return batches + [([w], 1, w[1].shape[0]) for w in windows if w[4]]
    groups: dict[int, list[MelWindow]] = {}
    for w in windows:
        n = w[1].shape[0]
        groups.setdefault(n if w[4] else shapes.length(n), []).append(w)
    batches = []
    for length, group in groups.items():
        most = shapes.row_sizes(length)[-1]
        for k in range(0, len(group), most):
            part = group[k:k + most]
            planned = length in shapes.lengths
            batches.append((part, shapes.rows(len(part), length) if planned else len(part),
                            length))
    return batches
